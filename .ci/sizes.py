"""The size check: no module of jkv over 400 lines, no function over 60 outside the Pallas
kernel bodies. Prints the largest of each; fails on one over its limit unless
`.ci/oversize.txt` lists it with a ceiling it stays within (a list that only shrinks: the
modules and functions still to be split). `--update` rewrites that list as things are now."""

from __future__ import annotations

import ast
import pathlib
import sys

MODULE_LINES, FUNCTION_LINES = 400, 60
ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = ROOT / ".ci" / "oversize.txt"


def is_kernel_body(path: str, name: str) -> bool:
    return path.startswith("jkv/pallas_kernels/") and name.endswith("_kernel")


def function_lines(path: str, tree: ast.AST) -> dict[str, int]:
    """Lines of every function in a module's tree, by path:qualname (kernel bodies aside)."""
    out = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and not is_kernel_body(path, child.name):
                    out[f"{path}:{name}"] = child.end_lineno - child.lineno + 1
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def measure() -> tuple[dict[str, int], dict[str, int]]:
    """Lines of every module under jkv/ and of every function in them."""
    modules, functions = {}, {}
    for f in sorted((ROOT / "jkv").rglob("*.py")):
        path = str(f.relative_to(ROOT))
        text = f.read_text()
        modules[path] = len(text.splitlines())
        functions |= function_lines(path, ast.parse(text))
    return modules, functions


def main() -> int:
    modules, functions = measure()
    over = {k: n for k, n in modules.items() if n > MODULE_LINES}
    over |= {k: n for k, n in functions.items() if n > FUNCTION_LINES}
    if "--update" in sys.argv:
        ALLOWED.write_text("".join(f"{k} {n}\n" for k, n in sorted(over.items())))
        return 0
    allowed = {}
    for line in ALLOWED.read_text().splitlines() if ALLOWED.exists() else []:
        name, ceiling = line.rsplit(" ", 1)
        allowed[name] = int(ceiling)
    print(f"largest modules (limit {MODULE_LINES} lines):")
    for k, n in sorted(modules.items(), key=lambda x: -x[1])[:5]:
        print(f"  {n:5d}  {k}")
    print(f"longest functions (limit {FUNCTION_LINES} lines, kernel bodies aside):")
    for k, n in sorted(functions.items(), key=lambda x: -x[1])[:5]:
        print(f"  {n:5d}  {k}")
    bad = [f"{k}: {n} lines" for k, n in sorted(over.items())
           if k not in allowed or n > allowed[k]]
    print(f"{len(over)} over the limits, {len(over) - len(bad)} of them listed in "
          f"{ALLOWED.relative_to(ROOT)} (to be split)")
    for k in sorted(set(allowed) - set(over)):
        print(f"  within the limit now, remove it from the list: {k}")
    if bad:
        print("over the limit and not listed (or grown past its ceiling):\n  "
              + "\n  ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
