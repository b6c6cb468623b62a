"""The package's wings import only downwards, and no module imports itself in a circle.

ckpt/ is a handful of wings, one per stage of the data path (see each wing's
__init__.py). A wing may import the wings below it and never those above, so
that a newcomer can read the package bottom-up and a change to the CLI or the
tiers can never break a save. This reads every import statement of the
package (at the top of a module or inside a function) with ``ast``; nothing is
imported or run. No module holds more than 500 lines of code (``code_lines``:
docstrings, comments and blank lines are not counted).
"""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "ckpt"

# Lowest first. save and restore share a floor and never import each other.
FLOORS = [("errors",), ("store",), ("format",), ("shards",), ("multihost",),
          ("commit",), ("save", "restore"), ("top",), ("face",), ("public",),
          ("tiers", "hf"),
          ("cli",)]
FLOOR = {wing: i for i, wings in enumerate(FLOORS) for wing in wings}
FACE = {"ckpt", "ckpt.__main__"}  # the public face may gather every wing
# The public classes at the top of ckpt/, built from the parts in ckpt/face/.
PUBLIC = {"ckpt.checkpointer"}
MAX_LINES = 500


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PKG.parent).with_suffix("").parts
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def wing(module: str) -> str:
  parts = module.split(".")
  if module == "ckpt.errors":
    return "errors"
  if module in PUBLIC:
    return "public"
  if len(parts) == 2 or module in FACE:
    return "top"
  return parts[1]


def imports(path: pathlib.Path, module: str) -> set[str]:
  """Every ckpt module that ``path`` imports (resolving ``from ckpt.x import y``
  to ckpt.x.y when y is a module)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.split(".")[0] == "ckpt"}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        pkg = module.split(".")
        if path.name != "__init__.py":
          pkg = pkg[:-1]
        pkg = pkg[:len(pkg) - node.level + 1]
        base = ".".join(pkg + ([base] if base else []))
      if base.split(".")[0] != "ckpt":
        continue
      for a in node.names:
        sub = f"{base}.{a.name}"
        found.add(sub if sub in MODULES else base)
  return found - {module}


PATHS = sorted(PKG.rglob("*.py"))
MODULES = {module_name(p) for p in PATHS}
GRAPH = {module_name(p): imports(p, module_name(p)) for p in PATHS}


def test_every_module_is_in_a_known_wing():
  unknown = sorted(m for m in MODULES if wing(m) not in FLOOR)
  assert not unknown, f"modules outside the wings {sorted(FLOOR)}: {unknown}"


def test_wings_import_only_downwards():
  bad = []
  for module, targets in GRAPH.items():
    if module in FACE:
      continue
    for target in targets:
      a, b = wing(module), wing(target)
      if a != b and FLOOR[b] >= FLOOR[a]:
        bad.append(f"{module} ({a}) imports {target} ({b})")
  assert not bad, "a lower wing imports a higher one:\n" + "\n".join(sorted(bad))


def test_no_import_cycle():
  # Package __init__ files import their wing's modules only for the face;
  # a cycle through them would show here too.
  state, stack, cycles = {}, [], []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for t in sorted(GRAPH.get(m, ())):
      if t not in GRAPH or t in FACE:
        continue
      if state.get(t) == 1:
        cycles.append(stack[stack.index(t):] + [t])
      elif t not in state:
        visit(t)
    stack.pop()
    state[m] = 2

  for m in sorted(GRAPH):
    if m not in state:
      visit(m)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def code_lines(text: str) -> int:
  """The lines of ``text`` (Python source) that hold code: every line on
  which a token lies (a string spanning lines counts each of its lines),
  except comments and docstrings. A docstring is the string that opens a
  module, a class or a function (the contract a reader reads, which the
  limit must not shorten). Blank lines, comment lines and docstring lines
  are not counted; a line holding code and a comment counts once."""
  tree = ast.parse(text)
  docstrings = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
          and isinstance(first.value.value, str)):
        docstrings.add((first.value.lineno, first.value.col_offset))
  lines = set()
  skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
          tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER}
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type in skip or (tok.type == tokenize.STRING and
                            tok.start in docstrings):
      continue
    lines.update(range(tok.start[0], tok.end[0] + 1))
  return len(lines)


def test_code_lines_counts_code_only():
  src = ('''"""Module doc,\n\nover lines."""\n\nimport os  # why\n\n'''
         '''# a comment\nclass A:\n  """Doc."""\n\n  def f(self):\n'''
         '''    """Doc\n    again."""\n    s = """not a\n    docstring"""\n'''
         '''    return (s,\n            os)\n''')
  # import, class, def, the assignment's 2 lines, the return's 2 lines.
  assert code_lines(src) == 7


def test_no_module_over_the_limit():
  long = {module_name(p): n for p in PATHS
          if (n := code_lines(p.read_text())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines of code: {long}"


@pytest.mark.parametrize("wing_dir", sorted(p.parent.name for p in PKG.glob("*/__init__.py")))
def test_each_wing_says_what_it_does_and_may_import(wing_dir):
  doc = ast.get_docstring(ast.parse((PKG / wing_dir / "__init__.py").read_text()))
  assert doc and "May import" in doc, f"ckpt/{wing_dir}/__init__.py needs a docstring with 'May import'"


# ---- the public classes are built from parts (issue 35) ---------------------

MAX_TOP_MODULES = 8
# Classes with more than one base: the error classes, each also the builtin
# error a caller may catch (CheckpointNotFoundError is a FileNotFoundError).
MULTI_BASE_OK = {"ckpt.errors"}
# The public classes and their parts use no private name of another module
# (no protected-access disable): a name another module needs is public, or
# a method of the part that owns it.
PARTS = ("ckpt.checkpointer", "ckpt.face", "ckpt.tiers")
# Modules of PARTS still reaching into a lower wing's private names, each
# with the change that removes it (the list only shrinks).
PRIVATE_PENDING: dict[str, str] = {}


def _trees():
  for p in PATHS:
    yield module_name(p), p, ast.parse(p.read_text(), str(p))


def test_at_most_eight_modules_at_the_top():
  top = sorted(p.name for p in PKG.glob("*.py"))
  assert len(top) <= MAX_TOP_MODULES, (
      f"{len(top)} modules at the top of ckpt/ (at most "
      f"{MAX_TOP_MODULES}: the public face; the rest goes into a wing): {top}")


def test_no_class_has_more_than_one_base():
  bad = [f"{m}.{n.name}" for m, _, t in _trees() if m not in MULTI_BASE_OK
         for n in ast.walk(t) if isinstance(n, ast.ClassDef) and len(n.bases) > 1]
  assert not bad, ("classes with more than one base (mixins sharing self; "
                   f"build them from parts that own their state): {bad}")


def _private_uses(module: str, path: pathlib.Path, tree: ast.AST) -> list[str]:
  """``from ckpt.x import _y``, ``x._y`` on anything but ``self``/``cls``
  (another module, another object's fields), and pylint's protected-access
  disables."""
  out = [f"{module}:{i}: protected-access disable" for i, line in
         enumerate(path.read_text().splitlines(), 1)
         if "disable=protected-access" in line]
  for n in ast.walk(tree):
    if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("ckpt"):
      out += [f"{module}:{n.lineno}: imports {n.module}.{a.name}"
              for a in n.names if _private(a.name)]
    elif (isinstance(n, ast.Attribute) and _private(n.attr) and not (
        isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))):
      out.append(f"{module}:{n.lineno}: uses {ast.unparse(n)}")
  return out


# ---- no shims, no reaching into another module's private names -------------
# Every module of ckpt/, the public face included: no exceptions.
PUBLIC_FACE = PKG / "__init__.py"  # gathers the public names by design


def _module_aliases(tree: ast.AST) -> dict[str, str]:
  """Local name -> ckpt module, for every import of a module (top level or
  inside a function)."""
  out = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckpt"):
      for a in node.names:
        if f"{node.module}.{a.name}" in MODULES:
          out[a.asname or a.name] = f"{node.module}.{a.name}"
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name in MODULES and a.asname:
          out[a.asname] = a.name
  return out


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def test_the_parts_use_no_private_name_of_another_module():
  bad = [u for m, p, t in _trees() if m not in PRIVATE_PENDING and
         m.startswith(PARTS) for u in _private_uses(m, p, t)]
  assert not bad, ("a private name used outside its module (make it public, "
                   "or a method of the part that owns it):\n" + "\n".join(bad))


def test_the_pending_list_only_shrinks():
  clean = sorted(m for m, p, t in _trees()
                 if m in PRIVATE_PENDING and not _private_uses(m, p, t))
  assert not clean, f"no longer reach into private names: drop them from PRIVATE_PENDING: {clean}"


def test_no_protected_access_disable():
  bad = [f"{p.relative_to(PKG.parent)}:{i}"
         for p in PATHS
         for i, line in enumerate(p.read_text().splitlines(), 1)
         if "disable=protected-access" in line]
  assert not bad, ("protected-access disabled (make the name public, or "
                   "give its owner a method):\n" + "\n".join(bad))


def test_no_import_of_another_modules_private_name():
  bad = []
  for p in PATHS:
    tree = ast.parse(p.read_text(), str(p))
    aliases = _module_aliases(tree)
    for node in ast.walk(tree):
      if (isinstance(node, ast.ImportFrom)
          and (node.module or "").startswith("ckpt")):
        bad += [f"{p.relative_to(PKG.parent)}:{node.lineno} imports "
                f"{node.module}.{a.name}" for a in node.names
                if _private(a.name)]
      elif (isinstance(node, ast.Attribute) and _private(node.attr)
            and isinstance(node.value, ast.Name) and node.value.id in aliases):
        bad.append(f"{p.relative_to(PKG.parent)}:{node.lineno} uses "
                   f"{aliases[node.value.id]}.{node.attr}")
  assert not bad, ("a module uses another's private name (make it public "
                   "or move it to its user):\n" + "\n".join(bad))


def _defined_and_imported(path: pathlib.Path) -> tuple[set[str], set[str]]:
  """(names a module defines at its top level, names it imports)."""
  defined, imported = set(), set()
  for node in ast.parse(path.read_text(), str(path)).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      defined.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.If,
                           ast.Try, ast.With, ast.For)):
      defined |= {n.id for n in ast.walk(node)
                  if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
      defined |= {n.name for n in ast.walk(node)
                  if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
  return defined, imported


DEFINES = {module_name(p): _defined_and_imported(p) for p in PATHS}


def test_no_re_export():
  """Each name is imported from the module that defines it: no module
  imports a ckpt name only for others to take from it, aliases another
  module's name (``X = other.X``) or holds nothing but imports."""
  bad = []
  for p in PATHS:
    if p == PUBLIC_FACE:
      continue
    rel = p.relative_to(PKG.parent)
    tree = ast.parse(p.read_text(), str(p))
    aliases = _module_aliases(tree)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    text = p.read_text()
    for node in tree.body:
      if (isinstance(node, ast.ImportFrom)
          and (node.module or "").startswith("ckpt")):
        for a in node.names:
          name = a.asname or a.name
          if (f"{node.module}.{a.name}" not in MODULES and name not in used
              and f'"{name}' not in text):  # a name in a string annotation
            bad.append(f"{rel}:{node.lineno} re-exports {node.module}.{a.name}")
      elif (isinstance(node, ast.Assign)
            and all(isinstance(t, ast.Name) for t in node.targets)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id in aliases):
        bad.append(f"{rel}:{node.lineno} aliases "
                   f"{aliases[node.value.value.id]}.{node.value.attr}")
    if all(isinstance(n, (ast.Import, ast.ImportFrom))
           or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
           for n in tree.body) and any(
               isinstance(n, ast.ImportFrom) for n in tree.body):
      bad.append(f"{rel} only re-exports")
    # a name taken through a module that did not define it
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in aliases):
        target = aliases[node.value.id]
        defined, imported = DEFINES[target]
        if (node.attr in imported and node.attr not in defined
            and f"{target}.{node.attr}" not in MODULES):
          bad.append(f"{rel}:{node.lineno} takes {node.attr} from {target}, "
                     "which only imports it")
  assert not bad, "re-exports (import from the defining module):\n" + "\n".join(bad)


def _bases_from_other_modules(tree: ast.AST) -> list[tuple[ast.ClassDef, str]]:
  """(class, base) for each base of a class that is a name imported from
  another ckpt module (``Checkpointer``, ``mod.Part``)."""
  imported = set()
  for node in ast.walk(tree):
    if (isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("ckpt")):
      imported |= {a.asname or a.name for a in node.names}
    elif isinstance(node, ast.Import):
      imported |= {a.asname or a.name.split(".")[0] for a in node.names
                   if a.name.split(".")[0] == "ckpt"}
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ClassDef):
      for base in node.bases:
        root = base
        while isinstance(root, ast.Attribute):
          root = root.value
        if isinstance(root, ast.Name) and root.id in imported:
          out.append((node, ast.unparse(base)))
  return out


def test_no_part_subclasses_another_modules_class():
  """A subclass reaches its base's private fields through ``self`` (as
  ``PersistentTier(Checkpointer)`` did to expose ``_known``, until issue
  46): the public classes and their parts subclass no class of another ckpt
  module, but the error classes (each a CheckpointError)."""
  bad = [f"{m}: class {c.name}({base})" for m, _, t in _trees()
         if m.startswith(PARTS) for c, base in _bases_from_other_modules(t)
         if not base.endswith("Error")]
  assert not bad, ("a part subclasses another module's class (compose it and "
                   "call its public methods instead):\n" + "\n".join(bad))


def test_the_subclass_check_catches_a_tier_reaching_into_a_checkpointer():
  src = ("from ckpt.checkpointer import Checkpointer\n"
         "from ckpt import errors\n"
         "class PersistentTier(Checkpointer):\n"
         "  def damaged(self):\n    return self._retention.damaged()\n"
         "class Refused(errors.CheckpointError):\n  pass\n")
  found = [(c.name, base) for c, base in
           _bases_from_other_modules(ast.parse(src))]
  assert found == [("PersistentTier", "Checkpointer"),
                   ("Refused", "errors.CheckpointError")]
