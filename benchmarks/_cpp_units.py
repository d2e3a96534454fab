"""A generated set of C++ translation units of realistic size, the same on every run.

Each unit is several hundred lines of what a real library's source file holds: a class
hierarchy with virtual functions, class templates (a fixed-capacity ring, an index over
``std::unordered_map``, a small matrix), function templates instantiated for several types,
STL containers and algorithms (``std::vector``, ``std::map``, ``std::string``,
``std::sort``, ``std::accumulate``), and one ``extern "C"`` entry point,
``unit<N>_checksum()``, that uses all of it so that nothing is optimised away. Sizes,
names and constants vary from unit to unit (a seeded ``random.Random``), so no two units
are alike and no compiler cache could share work between them.
"""

from __future__ import annotations

import random

__all__ = ["UNITS", "compile_unit", "unit"]

UNITS = 32

_HEADER = """\
// Generated translation unit {n}: {classes} classes, {functions} functions.
#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace unit{n} {{

template <typename T, std::size_t N>
class Ring {{
  public:
    void push(const T& value) {{
        items_[head_] = value;
        head_ = (head_ + 1) % N;
        size_ = std::min(size_ + 1, N);
    }}
    T sum() const {{ return std::accumulate(items_.begin(), items_.begin() + size_, T{{}}); }}
    std::size_t size() const {{ return size_; }}

  private:
    std::array<T, N> items_{{}};
    std::size_t head_ = 0;
    std::size_t size_ = 0;
}};

template <typename K, typename V>
class Index {{
  public:
    void add(const K& key, V value) {{ buckets_[key].push_back(std::move(value)); }}
    std::size_t count(const K& key) const {{
        auto found = buckets_.find(key);
        return found == buckets_.end() ? 0 : found->second.size();
    }}
    template <typename F>
    void each(F&& f) const {{
        std::vector<K> keys;
        keys.reserve(buckets_.size());
        for (const auto& entry : buckets_) keys.push_back(entry.first);
        std::sort(keys.begin(), keys.end());
        for (const auto& key : keys)
            for (const auto& value : buckets_.at(key)) f(key, value);
    }}

  private:
    std::unordered_map<K, std::vector<V>> buckets_;
}};

template <typename T, int R, int C>
struct Matrix {{
    std::array<T, R * C> cells{{}};
    T& at(int r, int c) {{ return cells[r * C + c]; }}
    const T& at(int r, int c) const {{ return cells[r * C + c]; }}
    template <int K>
    Matrix<T, R, K> operator*(const Matrix<T, C, K>& other) const {{
        Matrix<T, R, K> out;
        for (int i = 0; i < R; ++i)
            for (int j = 0; j < K; ++j) {{
                T acc{{}};
                for (int k = 0; k < C; ++k) acc += at(i, k) * other.at(k, j);
                out.at(i, j) = acc;
            }}
        return out;
    }}
    T trace() const {{
        T acc{{}};
        for (int i = 0; i < (R < C ? R : C); ++i) acc += at(i, i);
        return acc;
    }}
}};

class Shape {{
  public:
    virtual ~Shape() = default;
    virtual double area() const = 0;
    virtual std::string name() const = 0;
    virtual std::unique_ptr<Shape> scaled(double factor) const = 0;
}};
"""

_CLASS = """\
class {name} final : public Shape {{
  public:
    explicit {name}(double a, double b) : a_(a), b_(b) {{}}
    double area() const override {{ return {area}; }}
    std::string name() const override {{ return std::string("{name}-") + std::to_string({tag}); }}
    std::unique_ptr<Shape> scaled(double factor) const override {{
        return std::make_unique<{name}>(a_ * factor, b_ * factor);
    }}
    double perimeter() const {{ return {perimeter}; }}
    bool operator<(const {name}& other) const {{ return area() < other.area(); }}

  private:
    double a_;
    double b_;
}};
"""

_FUNCTION = """\
template <typename T>
T {name}(const std::vector<T>& values) {{
    std::vector<T> work(values);
    std::sort(work.begin(), work.end(), [](const T& x, const T& y) {{ return {compare}; }});
    std::map<T, int> histogram;
    for (const auto& v : work) histogram[v % T({modulus})] += 1;
    T acc = std::accumulate(work.begin(), work.end(), T({start}));
    for (const auto& [bucket, hits] : histogram) acc += bucket * T(hits);
    Ring<T, {ring}> ring;
    for (const auto& v : work) ring.push(v + T({offset}));
    return acc ^ ring.sum();
}}
"""

_AREAS = ["a_ * b_", "0.5 * a_ * b_", "3.14159 * a_ * b_", "a_ * a_ + b_", "(a_ + b_) * 0.25 * b_"]
_PERIMETERS = ["2 * (a_ + b_)", "a_ + b_ + std::abs(a_ - b_)", "6.28318 * (a_ + b_) / 2", "4 * a_ + b_"]
_COMPARES = ["x < y", "x > y", "(x % 7) < (y % 7) || ((x % 7) == (y % 7) && x < y)", "(x ^ 0x55) < (y ^ 0x55)"]


def unit(n: int) -> str:
    """The source of translation unit ``n``, the same every time."""
    rng = random.Random(1000 + n)
    classes = [f"Shape{n}_{i}" for i in range(rng.randint(10, 14))]
    functions = [f"fold{n}_{i}" for i in range(rng.randint(8, 12))]
    parts = [_HEADER.format(n=n, classes=len(classes), functions=len(functions))]
    for i, name in enumerate(classes):
        parts.append(_CLASS.format(name=name, area=rng.choice(_AREAS), perimeter=rng.choice(_PERIMETERS),
                                   tag=rng.randint(1, 999) + i))
    for name in functions:
        parts.append(_FUNCTION.format(name=name, compare=rng.choice(_COMPARES), modulus=rng.randint(3, 17),
                                      start=rng.randint(0, 99), ring=rng.choice([4, 8, 16, 32]),
                                      offset=rng.randint(1, 9)))
    body = ["", f"}}  // namespace unit{n}", "", f'extern "C" long unit{n}_checksum() {{',
            f"    using namespace unit{n};", "    std::vector<std::unique_ptr<Shape>> shapes;"]
    for i, name in enumerate(classes):
        body.append(f"    shapes.push_back(std::make_unique<{name}>({i + 1}.5, {rng.randint(1, 9)}.25));")
    body += [
        "    double total = 0;",
        "    Index<std::string, double> index;",
        "    for (const auto& shape : shapes) {",
        "        auto bigger = shape->scaled(2.0);",
        "        total += bigger->area() - shape->area();",
        "        index.add(shape->name().substr(0, 6), shape->area());",
        "    }",
        "    index.each([&](const std::string& key, double area) { total += area * double(key.size()); });",
        f"    std::vector<long> longs({rng.randint(50, 200)});",
        f"    std::vector<int> ints({rng.randint(50, 200)});",
        "    std::iota(longs.begin(), longs.end(), 3L);",
        "    std::iota(ints.begin(), ints.end(), 5);",
        "    long result = static_cast<long>(total);",
    ]
    for i, name in enumerate(functions):
        kind = "longs" if i % 2 == 0 else "ints"
        body.append(f"    result += static_cast<long>({name}({kind}));")
    dimension = rng.randint(3, 6)
    body += [
        f"    Matrix<double, {dimension}, {dimension}> m;",
        f"    for (int i = 0; i < {dimension}; ++i) m.at(i, i) = i + 1.0;",
        "    result += static_cast<long>((m * m).trace());",
        "    return result;",
        "}",
        "",
    ]
    return "".join(parts) + "\n".join(body)


def compile_unit(argv: list[str], source: str) -> bytes:
    """Run a compiler command line (``source.cpp`` in, ``libsource.so`` out) in a fresh
    directory and return the library's bytes: what a stdlib pool's job, or a serial loop,
    does for one unit. Module-level, so that a process pool can pickle it."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-native-") as work:
        with open(os.path.join(work, "source.cpp"), "w") as f:
            f.write(source)
        proc = subprocess.run(argv, cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": work, "LC_ALL": "C"})
        if proc.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout.decode(errors='replace')}")
        with open(os.path.join(work, "libsource.so"), "rb") as f:
            return f.read()
