"""Everything the config can name, registered: the built-in algorithms, models, server optimizers,
datasets and core-key values, the installed packages' ``fedjax_rcl.plugins`` entry points, and
the user's plugin modules that a run config names.

``fedjax_rcl.registry`` holds the tables and imports nothing of the package; this module sits
above every package that registers and imports them by name, so that the import graph
(``tests/test_architecture.py``) sees each arrow. Each package lists its own built-ins in its
``__init__`` (a new built-in is a module there and a line in that list); the models package
declares its models with what the config checks need and imports a model's code only when it
is built, so that validating ``model=`` or ``norm=`` imports no model. The imports are inside
``load`` so that importing this module stays light (the command line's ``--help`` imports no
JAX); whatever reads the tables calls ``load`` first (the config's schema and checks, the
configuration reference, the report).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys

from fedjax_rcl import registry

# The entry-point group an installed package declares its registering module in.
PLUGIN_GROUP = "fedjax_rcl.plugins"

_loaded = False


def load() -> None:
    """Registers every built-in entry and imports the installed packages' entry points (once;
    a later call does nothing)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    # Each package's __init__ imports (the models': declares) its built-ins; the values of
    # precision=, conv_impl= and norm= are registered by the modules that implement them.
    from fedjax_rcl import algorithms, datasets, models, server  # noqa: F401
    from fedjax_rcl.models import base  # noqa: F401
    from fedjax_rcl.nn import conv, norm  # noqa: F401

    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        ep.load()


def load_plugins(names, search=()) -> list[str]:
    """Imports the user's modules named in ``plugins`` (dotted module names), looked up on
    ``sys.path``, in the current directory (as ``python -m`` would) and in the directories
    ``search``; the entries each one registers get it as their ``origin``
    (``registry.owned_by``). Returns one problem line per module that cannot be imported, with
    a hint where to run from."""
    load()  # first: a plugin's own imports must not make built-ins its entries
    problems = []
    for folder in (os.getcwd(), *search):
        if folder and folder not in sys.path:
            sys.path.append(folder)
    for name in names or ():
        if not isinstance(name, str) or not name:
            problems.append(f"plugins: {name!r}: give a module name such as my_algorithms")
            continue
        try:
            with registry.owned_by(name):
                importlib.import_module(name)
        except Exception as e:  # a plugin's import error, whatever it is, is a config problem
            first = str(e).splitlines()[0] if str(e) else ""
            hint = ""
            if isinstance(e, ModuleNotFoundError) and e.name == name.split(".")[0]:
                looked = ", ".join(dict.fromkeys((os.getcwd(), *search)))
                hint = (f"; looked in {looked} and on sys.path: run from the directory that "
                        "holds it, or add that directory to PYTHONPATH")
            problems.append(f"plugins: cannot import {name!r} ({type(e).__name__}: {first})"
                            f"{hint}")
    return problems
