"""Triton's interpreter, sped up for the tests: the language is patched once per launch, not again
at every call of a @triton.jit helper inside a kernel.

`triton.runtime.interpreter` (triton 3.x) patches `triton.language` into its interpreted form when a
launch starts (and restores it when the launch ends), and again, from scratch, every time an
interpreted kernel calls a jitted helper (`InterpretedFunction.__call__` -> `_patch_lang`): an
`inspect.getmembers` walk over the language modules per call, about a third of the CPU time of
kernels that call helpers in their loops (paged attention's `_attend_range`, the norms, rotary). A
helper whose language modules are already patched (their builtins replaced) gets an empty patch
scope instead; anything else goes to Triton's own `_patch_lang`, so the kernels compute exactly what
they computed before (tests/test_interpreter_patch_once.py compares the two, bit for bit).
"""

from __future__ import annotations


def install() -> bool:
    """Wrap the interpreter's `_patch_lang` (once per process); False without Triton, or if this
    Triton has no such function."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False

    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not hasattr(interpreter, "_LangPatchScope") or getattr(original, "patched_once", False):
        return False
    langs_of: dict[object, tuple] = {}

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:  # the language modules `fn` sees, as Triton's _patch_lang finds them
            langs = langs_of[fn] = tuple(v for v in fn.__globals__.values() if v is tl or v is tl.core)
        if langs and all(not tl.core.is_builtin(lang.load) for lang in langs):  # patched by the running launch
            return interpreter._LangPatchScope()
        return original(fn)

    patch_lang.patched_once = True
    patch_lang.original = original
    interpreter._patch_lang = patch_lang
    return True
