#!/usr/bin/env python3
"""Checks that libkvferry.so exports the public API only (include/kvferry/export.h).

Every exported (dynamic, defined) symbol that names kvferry must name only identifiers the public
headers declare: a class, function or namespace that exists only in src/ (UcxTransport, an
anonymous namespace, ...) is a leak. Symbols of std::, __gnu_cxx:: and fmt:: (template code the
compiler instantiated) are counted as noise, anything else is a leak too: the C++ runtime's own
ABI (__cxa_throw, __cxxabiv1::...) included, which a library exports only when it carries a
static copy of the runtime and lets it out (a consumer's calls into its runtime may then bind to
that copy; cmake/install.cmake keeps static archives' symbols inside with --exclude-libs).

  check_exports.py LIB INCLUDE_DIR        reads the symbols with nm -D --defined-only
  check_exports.py --symbols FILE INCLUDE_DIR   reads demangled symbols, one a line (tests)
"""
import pathlib
import re
import subprocess
import sys

NOISE = ("std::", "__gnu_cxx::", "fmt::", "operator new", "operator delete")
PREFIXES = ("typeinfo name for ", "typeinfo for ", "vtable for ", "VTT for ",
            "construction vtable for ", "guard variable for ", "non-virtual thunk to ",
            "virtual thunk to ", "covariant return thunk to ")


def public_words(include_dir):
    words = set()
    for h in pathlib.Path(include_dir).glob("kvferry/*.h"):
        text = h.read_text()
        text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
        text = re.sub(r"//[^\n]*", " ", text)
        words.update(re.findall(r"[A-Za-z_]\w*", text))
    return words


def exported(lib):
    mangled = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True,
                             text=True).stdout.split("\n")
    names = [line.split()[-1] for line in mangled if len(line.split()) >= 3]
    demangled = subprocess.run(["c++filt"], input="\n".join(names), check=True,
                               capture_output=True, text=True).stdout.split("\n")
    return [d for d in demangled if d]


def leaks(symbols, words):
    bad, public, noise = [], 0, 0
    for sym in symbols:
        name = sym
        for p in PREFIXES:
            if name.startswith(p):
                name = name[len(p):]
        if "kvferry" not in name:
            if any(n in name for n in NOISE):
                noise += 1
            else:
                bad.append(sym)
            continue
        if "(anonymous namespace)" in name:
            bad.append(sym)
            continue
        # Every identifier of every kvferry-qualified name, arguments included.
        unknown = [w for q in re.findall(r"kvferry::(?:[A-Za-z_~]\w*::)*[A-Za-z_~]\w*", name)
                   for w in q.split("::")[1:] if w.lstrip("~") not in words]
        if unknown:
            bad.append(f"{sym}    (not in include/kvferry: {', '.join(sorted(set(unknown)))})")
        else:
            public += 1
    return bad, public, noise


def main(argv):
    if len(argv) == 4 and argv[1] == "--symbols":
        symbols = [s for s in pathlib.Path(argv[2]).read_text().split("\n") if s]
        include_dir = argv[3]
    elif len(argv) == 3:
        symbols = exported(argv[1])
        include_dir = argv[2]
    else:
        print(__doc__, file=sys.stderr)
        return 2
    bad, public, noise = leaks(symbols, public_words(include_dir))
    print(f"{len(symbols)} exported symbols: {public} public kvferry, {noise} std/fmt noise, "
          f"{len(bad)} leaked")
    for b in bad:
        print(f"  leaked: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
