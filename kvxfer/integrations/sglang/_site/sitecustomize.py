"""Registers kvxfer as an SGLang transfer backend in every Python process that starts with
KVXFER_SGLANG=1 and this folder on PYTHONPATH (what ``kvxfer.integrations.sglang.launch_server``
sets up), so SGLang's spawned scheduler processes see the backend too. It registers lazily, when
SGLang's disaggregation utilities are first imported, so unrelated processes pay nothing."""

import os
import sys

if os.environ.get("KVXFER_SGLANG") == "1":
    import importlib.abc
    import importlib.machinery

    _TARGET = "sglang.srt.disaggregation.utils"

    class _RegisterAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != _TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            original_exec = loader.exec_module

            def exec_module(module):
                original_exec(module)
                from kvxfer.integrations.sglang import register

                register()

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _RegisterAfterImport())

    # Chain to a sitecustomize further down the path, if there is one.
    _here = os.path.dirname(os.path.abspath(__file__))
    _rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    import importlib.util

    for _entry in _rest:
        _candidate = os.path.join(_entry or ".", "sitecustomize.py")
        if os.path.isfile(_candidate) and os.path.dirname(os.path.abspath(_candidate)) != _here:
            _spec = importlib.util.spec_from_file_location("_kvxfer_chained_sitecustomize", _candidate)
            if _spec and _spec.loader:
                _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
            break
