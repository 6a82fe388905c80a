"""Counts where a tfmp tree touches Keras and TensorFlow beyond their public API, and where it keeps state.

Reads the source of ``<tree>/tfmp`` (no import of that tree), so the same
counts can be taken on any commit::

    python scripts/keras_touch_points.py                 # this checkout
    git worktree add /tmp/old <commit> && python scripts/keras_touch_points.py /tmp/old

Printed as JSON:

- ``private_names``: distinct private Keras/TensorFlow names read (an underscore
  attribute of Keras's main classes and objects, or an import from
  ``keras.src`` / ``tensorflow.python``), and per module where they are read;
  ``private_outside_keras_hooks``: those read outside ``tfmp/_src/keras_hooks``.
- ``hook_sites``: calls that install a hook (``patches.install``, a surface's
  ``subscribe``), and ``hook_sites_outside_keras_hooks``: in how many modules
  outside ``keras_hooks`` they sit, and how many of those modules import
  ``patches`` itself.
- ``owners``: hook owners (the global ``ORDER`` table, or every surface's
  subscribers) and ``surfaces``: the number of `patches.Surface` made.
- ``module_stores``: module-level stores that start empty and fill at run time
  (``{}``, ``[]``, ``set()``, ``WeakSet``, ``WeakKeyDictionary``,
  ``PerObject``, ``threading.local()``, ``dict()``, ``list()``; constant
  tables are not counted) and in how many modules.
- ``hidden_attributes``: distinct ``_tfmp_*`` names set or read on objects, and
  ``per_object_kinds``: `PerObject` stores (tfmp state kept in an object's
  ``__dict__`` under one hidden key each).
"""

from __future__ import annotations

import ast
import json
import pathlib
import sys
from typing import Dict, List, Set

STORE_CALLS = {"set", "dict", "list", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "PerObject",
               "PerObjectHooks", "local", "defaultdict", "OrderedDict"}


def private_names() -> Set[str]:
    """Underscore names of Keras's main classes and of a compiled model's objects (the installed Keras)."""
    import keras

    classes = (keras.layers.Layer, keras.Model, keras.Sequential, keras.optimizers.Optimizer,
               keras.optimizers.LossScaleOptimizer, keras.KerasTensor, keras.Variable,
               keras.callbacks.Callback, keras.metrics.Mean, keras.DTypePolicy)
    names = {n for cls in classes for n in dir(cls) if n.startswith("_") and not n.startswith("__")}
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    for obj in (model, model.layers[0], model.optimizer, model.outputs[0]):
        names |= {n for n in vars(obj) if n.startswith("_") and not n.startswith("__")}
    return names


def private_uses(tree: ast.AST, names: Set[str]) -> Set[str]:
    """The names of `names` a module's syntax tree reads, and its imports of Keras's or TensorFlow's internals."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.add(node.value)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = getattr(node, "module", None) or ""
            for alias in node.names:
                full = f"{module}.{alias.name}" if module else alias.name
                if full.startswith(("keras.src", "tensorflow.python")) or module.startswith(
                    ("keras.src", "tensorflow.python")
                ):
                    found.add(full)
    return found


def _is_hook_site(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        if func.attr == "install" and isinstance(func.value, ast.Name) and func.value.id == "patches":
            return True
        return func.attr == "subscribe" and len(node.args) >= 2
    return False


def _module_stores(tree: ast.Module) -> int:
    count = 0
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if value is None:
            continue
        if isinstance(value, (ast.Dict, ast.List, ast.Set)):  # a constant table is not a store
            count += not (getattr(value, "keys", None) or getattr(value, "elts", None))
        elif isinstance(value, ast.Call):
            func = value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            count += name in STORE_CALLS
    return count


def count(root: pathlib.Path, names: Set[str]) -> Dict[str, object]:
    package = root / "tfmp"
    private: Dict[str, List[str]] = {}
    sites, outside_site_modules, patches_importers = 0, set(), set()
    owners: Set[str] = set()
    surfaces = 0
    stores, store_modules = 0, set()
    hidden: Set[str] = set()
    per_object: Set[str] = set()
    for path in sorted(package.rglob("*.py")):
        relative = str(path.relative_to(root))
        inside = "keras_hooks" in path.parts
        tree = ast.parse(path.read_text())
        used = private_uses(tree, names)
        if used:
            private[relative] = sorted(used)
        module_stores = _module_stores(tree)
        if module_stores:
            stores += module_stores
            store_modules.add(relative)
        for node in ast.walk(tree):
            if _is_hook_site(node):
                sites += 1
                if not inside:
                    outside_site_modules.add(relative)
            if isinstance(node, ast.ImportFrom) and not inside:
                if any(alias.name == "patches" for alias in node.names) or (node.module or "").endswith(".patches"):
                    patches_importers.add(relative)
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_tfmp_")
                    and node.value != "_tfmp_"):  # the prefix `PerObject` keys its stores with
                hidden.add(node.value)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_tfmp_"):
                hidden.add(node.attr)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("PerObject", "PerObjectHooks") and node.args:
                per_object.add(ast.unparse(node.args[0]))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Surface":
                surfaces += 1
                for keyword in node.keywords:
                    if keyword.arg == "subscribers":
                        owners |= {elt.value for elt in keyword.value.elts}
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and getattr(node.targets[0], "id", None) == "ORDER" and isinstance(node.value, ast.Dict)):
                owners |= {key.value for key in node.value.keys}
    all_private = sorted({name for used in private.values() for name in used})
    outside = sorted({name for module, used in private.items() if "keras_hooks" not in module for name in used})
    return {
        "private_names": len(all_private),
        "private_name_modules": private,
        "private_outside_keras_hooks": outside,
        "hook_sites": sites,
        "hook_sites_outside_keras_hooks": {"modules": len(outside_site_modules),
                                           "modules_importing_patches": len(patches_importers)},
        "owners": len(owners),
        "surfaces": surfaces,
        "module_stores": {"stores": stores, "modules": len(store_modules)},
        "hidden_attributes": sorted(hidden),
        "per_object_kinds": len(per_object),
    }


def main(argv: List[str]) -> None:
    root = pathlib.Path(argv[0]) if argv else pathlib.Path(__file__).resolve().parents[1]
    print(json.dumps(count(root, private_names()), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
