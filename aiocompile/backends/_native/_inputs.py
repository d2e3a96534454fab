"""What a native command line reads besides the source and its headers, for the key.

Every file the compiler or the linker reads belongs in the key, or an edit to it would be
answered with the library built before it. Besides the headers (``_headers``) and the
environment (``_compiler.environment``), those are:

- **Response files.** ``@file`` among the flags (GCC's and Clang's), and ``-Wl,@file`` or
  ``-Xlinker @file`` (the linker's), are read here and replaced by the arguments they hold,
  split as GCC splits them (whitespace between arguments, single and double quotes,
  backslash escapes), a nested ``@file`` expanded in turn. The compile then runs the
  expanded command line: the key holds exactly what the compiler is told, and a relative
  path inside a response file is taken from the caller's current directory, like every
  relative path in flags. A name that is no file stays as it is (the compiler will say
  so); a response file that is not a regular file (a FIFO), or that names itself, is
  refused with ``ValueError``.
- **Files named in flags.** Any argument, the value after an ``=`` in one, or a part of a
  list passed on to another program (``-Wl,--version-script=exports.map``,
  ``-Wl,-T,script.ld``, ``-Xlinker``, nvcc's ``-Xcompiler``), that names a regular file has
  that file's contents keyed: linker and version scripts, objects and archives, plugins,
  profiles, spec files. A word that happens to be the name of a file makes a key change
  for nothing, never the other way round. Where the word is plainly a file (an input among
  the flags, the script of ``-T``, a linker option's file), a relative path is made
  absolute: the compile runs in a scratch directory.
- **Libraries** named by ``-lNAME`` (or ``libraries=("NAME",)``): ``libNAME.so`` and
  ``libNAME.a`` in each ``-L`` directory and each directory of ``LIBRARY_PATH``. The
  system's own are not read: the compiler's identity stands for them, as for its headers.

nvcc reads ``--options-file`` by rules of its own, and hands ``-Xcompiler @file`` to the
host compiler: neither can be keyed here, so both are refused with ``ValueError``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from aiocompile.backends._native._headers import HeaderIndex, read_regular

__all__ = ["Inputs", "expand_response_files", "named_files", "refuse_unkeyable", "split_response_file"]

_SPACE = frozenset(" \t\n\v\f\r")
_MAX_DEPTH = 32
"""Response files nested deeper than this are refused (GCC gives up on a loop as well)."""

# Options of the GCC and Clang drivers whose argument is the next word: that word is not
# an input file, whatever it looks like.
_TAKES_NEXT = frozenset({
    "-o", "-x", "-I", "-include", "-imacros", "-iquote", "-isystem", "-idirafter", "-iprefix", "-iwithprefix",
    "-iwithprefixbefore", "-isysroot", "-imultilib", "-L", "-l", "-T", "-Xlinker", "-Xassembler",
    "-Xpreprocessor", "-Xclang", "-MF", "-MT", "-MQ", "-D", "-U", "-A", "-u", "-z", "-e", "-aux-info", "-wrapper",
    "-B", "--param", "-dumpbase", "-dumpdir", "-dumpbase-ext", "--sysroot", "-target", "--target", "-arch",
    "-mllvm", "-Xopenmp-target",
})
# Driver options whose value after "=" is a file the compile reads.
_FILE_VALUES = frozenset({
    "-specs", "--specs", "-fplugin", "-fprofile-use", "-fprofile-sample-use", "-fauto-profile",
    "-fprofile-instr-use", "-fsanitize-ignorelist", "-fsanitize-blacklist",
})
# Linker options naming a file the linker reads: "--opt=file", or "--opt file".
_LINKER_FILES = frozenset({
    "-T", "--script", "-dT", "--default-script", "--version-script", "--dynamic-list", "--retain-symbols-file",
    "--just-symbols",
})
# Options that pass a comma-separated list on to another program (GCC: "-Wl,a,b"; nvcc:
# "-Xcompiler a,b" or "-Xcompiler=a,b").
_GLUED_LISTS = ("-Wl,", "-Wa,", "-Wp,")
_LISTS = frozenset({"-Xlinker", "-Xassembler", "-Xpreprocessor", "-Xcompiler", "--compiler-options", "-Xptxas",
                    "--ptxas-options", "-Xnvlink", "--nvlink-options", "-Xcudafe", "-Xarchive", "-wrapper"})


@dataclass(frozen=True)
class Inputs:
    flags: tuple[str, ...]
    """The flags with the paths of the files they plainly name made absolute."""
    files: tuple[tuple[str, str], ...]
    """(absolute path, SHA-256) of each regular file a word of the flags names, or that
    ``-l`` finds in a ``-L`` directory or ``LIBRARY_PATH``; sorted."""


def split_response_file(text: str) -> list[str]:
    """The arguments a response file holds, split as GCC's ``buildargv`` splits them."""
    args: list[str] = []
    current: list[str] = []
    started = single = double = escaped = False
    for ch in text:
        if ch in _SPACE and not (single or double or escaped):
            if started:
                args.append("".join(current))
                current, started = [], False
            continue
        started = True
        if escaped:
            escaped = False
            current.append(ch)
        elif ch == "\\":
            escaped = True
        elif single:
            single = ch != "'"
            if single:
                current.append(ch)
        elif double:
            double = ch != '"'
            if double:
                current.append(ch)
        elif ch in "'\"":
            single, double = ch == "'", ch == '"'
        else:
            current.append(ch)
    if started:
        args.append("".join(current))
    return args


def _read_response_file(name: str, cwd: str, chain: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """(real path, arguments) of the response file ``@name``; None where there is no such
    file, or it is a directory (the compiler takes the word as it is, then)."""
    path = os.path.normpath(os.path.join(cwd, name))
    try:
        is_dir = os.path.isdir(path)
        exists = os.path.exists(path)
    except OSError:
        return None
    if is_dir or not exists:
        return None
    real = os.path.realpath(path)
    if real in chain:
        raise ValueError(f"flags: the response file @{name} names itself (through "
                         f"{' -> '.join('@' + p for p in (*chain, real))}): it cannot be expanded")
    if len(chain) >= _MAX_DEPTH:
        raise ValueError(f"flags: response files nested more than {_MAX_DEPTH} deep (@{name})")
    data = read_regular(path)
    if data is None:
        raise ValueError(f"flags: the response file @{name} is not a regular file that can be read; what the "
                         "compiler would read from it could not be keyed")
    return real, split_response_file(data.decode("utf-8", errors="surrogateescape"))


def _expand(tokens: Sequence[str], cwd: str, chain: tuple[str, ...], linker: bool) -> list[str]:
    out: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        read = _read_response_file(token[1:], cwd, chain) if token.startswith("@") and len(token) > 1 else None
        if read is not None:
            real, args = read
            out += _expand(args, cwd, (*chain, real), linker)
        elif linker:
            out.append(token)
        elif token.startswith("-Wl,") and any(part.startswith("@") for part in token[4:].split(",")):
            # The linker's own response files, expanded for it: one -Xlinker per argument
            # (an argument of the file may hold a comma, which -Wl would split).
            for part in _expand(token[4:].split(","), cwd, chain, linker=True):
                out += ["-Xlinker", part]
        elif token == "-Xlinker" and index < len(tokens) and tokens[index].startswith("@"):
            for part in _expand(tokens[index:index + 1], cwd, chain, linker=True):
                out += ["-Xlinker", part]
            index += 1
        else:
            out.append(token)
    return out


def expand_response_files(flags: Sequence[str], cwd: str) -> tuple[str, ...]:
    """``flags`` with every response file (``@file``, ``-Wl,@file``, ``-Xlinker @file``)
    replaced by the arguments it holds, nested ones too; relative names from ``cwd``."""
    if not any("@" in flag for flag in flags):
        return tuple(flags)
    return tuple(_expand(flags, cwd, (), linker=False))


def refuse_unkeyable(flags: Sequence[str]) -> None:
    """``ValueError`` for nvcc flags that make a program read files no key can follow:
    an options file, a response file passed on to the host compiler or linker."""
    for index, flag in enumerate(flags):
        option, _, value = flag.partition("=")
        if option in ("--options-file", "-optf"):
            raise ValueError(f"flags[{index}]: {option} cannot be keyed (nvcc reads it by rules of its own, and the "
                             "files its options name would not be): give its options in flags")
        if option not in _LISTS:
            continue
        passed = value or (flags[index + 1] if index + 1 < len(flags) else "")
        if any(part.startswith("@") for part in passed.split(",")):
            raise ValueError(f"flags[{index}]: a response file passed on by {option} ({passed!r}) cannot be keyed: "
                             "give its options in flags")


def _absolute(word: str, cwd: str) -> str:
    """``word`` made absolute where it is a relative path to a regular file from ``cwd``."""
    if not word or os.path.isabs(word):
        return word
    path = os.path.normpath(os.path.join(cwd, word))
    return path if os.path.isfile(path) else word


def _linker_part(parts: list[str], index: int, cwd: str) -> str:
    part = parts[index]
    option, equals, value = part.partition("=")
    if equals and option in _LINKER_FILES:
        return f"{option}={_absolute(value, cwd)}"
    if index > 0 and parts[index - 1] in _LINKER_FILES:
        return _absolute(part, cwd)
    return part


def _rewrite(flags: Sequence[str], cwd: str) -> list[str]:
    """The flags with the relative paths of files they plainly name made absolute: an
    input among the flags, the script after ``-T``, a file option's value, a linker
    option's file (in ``-Wl,`` lists and after ``-Xlinker``)."""
    out = list(flags)
    linker_args: list[int] = []
    index = 0
    while index < len(out):
        token = out[index]
        option, equals, value = token.partition("=")
        if token in _TAKES_NEXT and index + 1 < len(out):
            if token == "-T":
                out[index + 1] = _absolute(out[index + 1], cwd)
            elif token == "-Xlinker":
                linker_args.append(index + 1)
            index += 2
            continue
        if token.startswith("-T") and len(token) > 2 and "=" not in token:
            out[index] = "-T" + _absolute(token[2:], cwd)
        elif token.startswith("-Wl,"):
            parts = token[4:].split(",")
            out[index] = "-Wl," + ",".join(_linker_part(parts, n, cwd) for n in range(len(parts)))
        elif equals and option in _FILE_VALUES:
            out[index] = f"{option}={_absolute(value, cwd)}"
        elif not token.startswith("-"):
            out[index] = _absolute(token, cwd)
        index += 1
    if linker_args:
        parts = [out[n] for n in linker_args]
        for n, position in enumerate(linker_args):
            out[position] = _linker_part(parts, n, cwd)
    return out


def _words(flags: Sequence[str]) -> Iterable[str]:
    """Every word of the flags that may name a file: each flag, its value after "=", and
    each part of a list passed on to another program, with its value after "=" too."""
    for index, flag in enumerate(flags):
        option, equals, value = flag.partition("=")
        parts = [flag]
        if flag.startswith(_GLUED_LISTS):
            parts += flag[4:].split(",")
        elif flag.startswith("-T") and len(flag) > 2:
            parts.append(flag[2:])
        elif option in _LISTS and equals:
            parts += value.split(",")
        elif equals:
            parts.append(value)
        if index > 0 and flags[index - 1] in _LISTS:
            parts += flag.split(",")
        for part in parts:
            yield part
            if "=" in part:
                yield part.partition("=")[2]


def _libraries(flags: Sequence[str], libraries: Sequence[str], library_path: str | None) -> list[str]:
    """Where the libraries named by ``-l`` may be found, outside the system's directories."""
    directories: list[str] = []
    names: list[str] = []
    for index, flag in enumerate(flags):
        following = flags[index + 1] if index + 1 < len(flags) else ""
        if flag in ("-L", "-l"):
            (directories if flag == "-L" else names).append(following)
        elif flag.startswith("-L"):
            directories.append(flag[2:])
        elif flag.startswith("-l"):
            names.append(flag[2:])
    names += [library[2:] for library in libraries if library.startswith("-l")]
    directories += [d for d in (library_path or "").split(os.pathsep) if d]
    found = []
    for name in names:
        files = [name[1:]] if name.startswith(":") else [f"lib{name}.so", f"lib{name}.a"]
        found += [os.path.join(directory, file) for directory in directories for file in files if file]
    return found


def named_files(flags: Sequence[str], cwd: str, index: HeaderIndex, *, driver: bool,
                libraries: Sequence[str] = (), library_path: str | None = None) -> Inputs:
    """The files ``flags`` name, keyed (see the module's docstring). ``driver``: the flags
    are a GCC or Clang driver's, whose inputs and file options are known well enough to
    make their relative paths absolute; nvcc's are keyed only. ``libraries`` are further
    ``-lNAME`` arguments; ``library_path`` is ``LIBRARY_PATH``."""
    rewritten = _rewrite(flags, cwd) if driver else list(flags)
    files: dict[str, str] = {}
    for word in (*_words(rewritten), *_libraries(rewritten, libraries, library_path)):
        path = word if os.path.isabs(word) else os.path.normpath(os.path.join(cwd, word)) if word else ""
        if path and path not in files and os.path.isfile(path):
            digest = index.digest(path)
            if digest is not None:
                files[path] = digest
    return Inputs(tuple(rewritten), tuple(sorted(files.items())))
