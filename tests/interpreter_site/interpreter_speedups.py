"""Cheaper Triton-interpreter internals for the tests (CPU machines, ``TRITON_INTERPRET=1``).

The interpreter runs each kernel program in Python and spends most of its time in per-operation bookkeeping;
the replacements below remove work whose result is the same every time or never used. The kernels run the
same interpreted code and give the same values. :func:`apply` is called by tests/conftest.py in the pytest
process and, through ``sitecustomize.py`` in this folder (on PYTHONPATH for the processes the tests start:
notebook kernels, gloo ranks, helper processes), once a child process's ``import triton`` has finished.
MOELORA_PLAIN_INTERPRETER=1 leaves the interpreter as Triton ships it.
"""

from __future__ import annotations

import os

_applied = False


def apply() -> None:
    """Install the replacements once per process; each is left out if this Triton has other internals."""
    global _applied
    if _applied or os.environ.get("MOELORA_PLAIN_INTERPRETER") == "1":
        return
    _applied = True
    _patch_lang_once_per_launch()
    _no_dead_overflow_checks()
    _cheaper_interpreter_types()


def _patch_lang_once_per_launch() -> None:
    """Triton's interpreter swaps triton.language's builtins for interpreted ones (``_patch_lang``: an
    ``inspect.getmembers`` walk of tl, tl.tensor, tl.math, ...) at each launch and again at every call of a
    ``@triton.jit`` device function from inside it, where the builtins are already swapped and the walk
    changes nothing: about a fifth of the interpreted test time. Here a device call skips the walk when the
    launch has already swapped the modules its function sees; the kernels run the same interpreted code.
    Left as it is if this Triton has other internals."""
    import triton.language as tl
    from triton.runtime import interpreter as ti

    real_patch, executor = getattr(ti, "_patch_lang", None), getattr(ti, "GridExecutor", None)
    if real_patch is None or executor is None or not hasattr(ti, "_LangPatchScope"):
        return
    real_call, swapped = executor.__call__, []  # swapped: the lang modules the running launch swapped

    seen_langs: dict = {}  # (id, size) of a module's globals -> its lang modules: one walk per module

    def langs_of(fn):
        g = fn.__globals__
        key = (id(g), len(g))
        if key not in seen_langs:
            seen_langs[key] = {id(v) for v in g.values() if isinstance(v, type(tl)) and v in (tl, tl.core)}
        return seen_langs[key]

    def patch_lang(fn):
        langs = langs_of(fn)
        if swapped and langs <= swapped[0]:
            return ti._LangPatchScope()  # nothing to restore
        scope = real_patch(fn)
        if swapped:
            swapped[0] |= langs
        else:
            swapped.append(set(langs))  # a copy: the cached set stays as it is
        return scope

    def call(self, *args, **kwargs):
        outer = not swapped
        try:
            return real_call(self, *args, **kwargs)
        finally:
            if outer:
                swapped.clear()

    ti._patch_lang = patch_lang
    executor.__call__ = call


def _cheaper_interpreter_types() -> None:
    """Bookkeeping of Triton's interpreter that runs at every interpreted operation, made cheaper:

    * ``tl.core.tensor`` wraps its shape in a ``tl.tuple`` whose ``tuple_type`` formats a ``name`` string from
      every element type when it is built (a few hundred thousand times a test file); the name is read only
      when a type is printed, so here it is formatted then, from the same types and fields;
    * the ``tl.tuple`` of that shape computes its ``tuple_type`` from its values when it is built; here when
      the type is first read (from the values as they were given);
    * the interpreter's ``_get_np_dtype`` builds its Triton → numpy dtype table at every call; here each
      answer is kept per Triton dtype (dtypes hash and compare by name).

    Each replacement is checked against the original on sample values first and left out if they differ,
    or if this Triton has other internals. The kernels run the same interpreted code."""
    import triton.language as tl
    from triton.language import core
    from triton.runtime import interpreter as ti

    tuple_type = getattr(core, "tuple_type", None)
    if isinstance(tuple_type, type) and "name" not in vars(tuple_type):
        real_init = tuple_type.__init__

        def init(self, types, fields=None):
            self.types = types
            self.fields = fields or [""] * len(types)

        def get_name(self):
            given = self.__dict__.get("_given_name")
            if given is not None:
                return given
            return "[" + ",".join(f"{k}:{v}" for k, v in zip(self.fields, self.types)) + "]"

        def set_name(self, value):
            self.__dict__["_given_name"] = value

        sample = ([tl.int32, tl.constexpr_type(4)], None), ([tl.float16], ["x"]), ([], None)
        ref = []
        for types, fields in sample:
            t = object.__new__(tuple_type)
            real_init(t, list(types), fields)
            ref.append((t.types, t.fields, t.name))
        tuple_type.__init__, tuple_type.name = init, property(get_name, set_name)
        mine = [(t.types, t.fields, t.name) for t in (tuple_type(list(ty), f) for ty, f in sample)]
        if [(a, b, str(c)) for a, b, c in ref] != [(a, b, str(c)) for a, b, c in mine]:
            tuple_type.__init__ = real_init
            del tuple_type.name

    lang_tuple = getattr(core, "tuple", None)
    if (
        isinstance(lang_tuple, type)
        and isinstance(tuple_type, type)  # the replacement builds tuple_type from a given list
        and "type" not in vars(lang_tuple)
        and callable(getattr(core, "_type_for_tuple_values", None))
    ):
        real_tuple_init = lang_tuple.__init__

        def tuple_init(self, args, type=None):
            self.values = [i for i in args]
            if isinstance(type, tuple_type):
                self.type = type
            elif type is not None:
                self.type = tuple_type(type)
            else:  # the type of the values as given, built when first read
                self.__dict__["_values_for_type"] = list(self.values)

        def get_type(self):
            d = self.__dict__
            if "_type" not in d:
                d["_type"] = core._type_for_tuple_values(d.pop("_values_for_type"))
            return d["_type"]

        def set_type(self, value):
            self.__dict__.pop("_values_for_type", None)
            self.__dict__["_type"] = value

        sample = [tl.constexpr(3), tl.constexpr(5)], [tl.constexpr(1)], []
        ref = []
        for values in sample:
            t = object.__new__(lang_tuple)
            real_tuple_init(t, values)
            ref.append(str(t.type))
        lang_tuple.__init__, lang_tuple.type = tuple_init, property(get_type, set_type)
        if [str(lang_tuple(v).type) for v in sample] != ref:
            lang_tuple.__init__ = real_tuple_init
            del lang_tuple.type

    real_np_dtype = getattr(ti, "_get_np_dtype", None)
    if real_np_dtype is not None:
        known: dict = {}

        def np_dtype(tt_dtype):
            if isinstance(tt_dtype, tl.block_type):
                tt_dtype = tt_dtype.element_ty
            if isinstance(tt_dtype, tl.pointer_type):
                return real_np_dtype(tt_dtype)
            try:
                return known[tt_dtype]
            except KeyError:
                known[tt_dtype] = real_np_dtype(tt_dtype)
                return known[tt_dtype]

        sample = [tl.float16, tl.bfloat16, tl.int1, tl.uint64, tl.block_type(tl.float32, [4])]
        sample.append(tl.pointer_type(tl.float32))
        if all(np_dtype(d) == real_np_dtype(d) for d in sample + sample):
            ti._get_np_dtype = np_dtype


def _no_dead_overflow_checks() -> None:
    """Triton's integer-overflow sanitizer recomputes every int add/sub/mul in int64 and compares it with the
    type's range, for a ``device_assert`` that returns at once unless ``debug`` is on (the interpreter's
    builder never turns it on): about a third of the interpreted time, for no effect. Switched off only while
    ``debug`` is off, and only where this Triton's ``device_assert`` has that early return."""
    import inspect
    from dataclasses import replace

    from triton.language import semantic
    from triton.runtime import interpreter as ti

    builder = getattr(ti, "InterpreterBuilder", None)
    device_assert = getattr(getattr(semantic, "TritonSemantic", None), "device_assert", None)
    assert_src = inspect.getsource(device_assert) if device_assert is not None else ""
    if builder is None or "if not self.builder.options.debug:" not in assert_src:
        return
    real_init = builder.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if not self.options.debug:
            self.options = replace(self.options, sanitize_overflow=False)

    builder.__init__ = init
    shared = getattr(ti, "interpreter_builder", None)
    if shared is not None and not shared.options.debug:
        shared.options = replace(shared.options, sanitize_overflow=False)
