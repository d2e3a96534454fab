"""aiocompile's version, where any module can read it without importing the package's front door."""

VERSION = "0.1.0"
