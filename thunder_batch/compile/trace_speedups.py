"""Cheaper Thunder tracing, same traces. Profiling the default model's cold trace showed most of the
time in Thunder's bytecode interpreter, and within it these avoidable costs (the profile's shares:
benchmarks/RESULTS.md, "Numbers moved from the code's comments"; what the speedups save: "Layered step
program"):

1. Every `module(x)` interprets `nn.Module._call_impl`, whose "any hooks?" test evaluates eight
   hook dicts through Thunder's interpreted `bool`/`len` (a large share of interpreted work). A lookaside
   makes the same test natively and, when no hook is registered and TorchScript is not tracing,
   interprets `self.forward(...)` directly: exactly the path `_call_impl` takes in that case.
   With hooks, the original `_call_impl` is interpreted as before.
2. Every `d[k]` on a plain dict, and every global or builtin name lookup (two of them), runs
   through an interpreted helper (`getitem_impl`, `lambda d, k: d[k]`) that ends in the dict's
   provenance-tracking `__getitem__` (the largest share). The fast path calls that `__getitem__` directly; any
   other container, or a dict without item tracking, takes the original route.
3. The interpreter disassembles a function's bytecode on every call (`dis.get_instructions`). Code
   objects are immutable, so the instruction tuple is memoized per code object.
4. Each exception leaving an interpreted frame builds a Python frame in a helper thread while the
   caller spins holding the GIL (milliseconds per exception, and a default-model trace raises many). The
   same frame is built the same way; the caller waits on a lock instead of spinning.

Each shortcut reproduces what the code it skips does; they rely on Thunder/torch internals, so
`install()` checks the source of every function it stands in for against the versions verified
here (traces identical with and without, tests/test_trace_speedups.py) and installs nothing if any
differs, saying so once in the log; `status()` says whether they are on and, if not, why (the
engine's stats report it). `install()` is idempotent; `uninstall()` restores Thunder's behaviour;
THUNDER_BATCH_FAST_TRACE=0 turns the speedups off. torch.nn.Module._call_impl has the same source
in torch 2.11 as in 2.13 (read from the 2.11.0 wheel), so the speedups hold on both.
"""

from __future__ import annotations

import dis
import hashlib
import inspect
import logging
import os
import types

import torch
from torch.nn.modules import module as module_mod

_HOOK_DICTS = (
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
)
# sha256[:16] of the source of each function a shortcut stands in for, as verified.
_VERIFIED_SOURCES = {
    "interpreter.globals_lookup": "7cc0d44bcf43854c",
    "interpreter._binary_subscr": "68a5bc7b867178e9",
    "interpreter.MutMappingWrapperMethods.__getitem__": "e6557ffe5e2167a6",
    "interpreter._run_frame": "4d18ac7c58fbcf36",  # the only caller of dis.get_instructions
    "interpreter.InterpreterFrame.get_or_make_python_frame": "5b5ddf0171f34fb9",
    "torch.nn.Module._call_impl": "62587dee2896dff4",
}
_installed: dict = {}
_off_reason: list[str] = []  # why install() installed nothing (logged once)


def _has_hooks(m: torch.nn.Module) -> bool:
    return bool(
        m._backward_hooks
        or m._backward_pre_hooks
        or m._forward_hooks
        or m._forward_pre_hooks
        or any(getattr(module_mod, name) for name in _HOOK_DICTS)
    )


def _direct_forward(self, *args, **kwargs):
    return self.forward(*args, **kwargs)


class _CachedDis(types.ModuleType):
    """`dis` for Thunder's interpreter, with get_instructions memoized per code object."""

    def __init__(self) -> None:
        super().__init__("dis")
        self._cache: dict[int, tuple] = {}

    def __getattr__(self, name):
        return getattr(dis, name)

    def get_instructions(self, code, **kwargs):
        if kwargs or not isinstance(code, types.CodeType):
            return dis.get_instructions(code, **kwargs)
        hit = self._cache.get(id(code))
        if hit is None or hit[0] is not code:
            hit = self._cache[id(code)] = (code, tuple(dis.get_instructions(code)))  # keeps code alive: id stays unique
        return iter(hit[1])


def unverified_sources() -> list[str]:
    """Functions whose source differs from the verified one (then nothing is installed)."""
    from thunder.core import interpreter

    scope = {"interpreter": interpreter, "torch": torch}
    replaced = {
        "interpreter.globals_lookup": "globals_lookup",
        "interpreter._binary_subscr": "binary_subscr",
        "interpreter.InterpreterFrame.get_or_make_python_frame": "python_frame",
    }
    changed = []
    for dotted, digest in _VERIFIED_SOURCES.items():
        head, *rest = dotted.split(".")
        obj = scope[head]
        try:
            for part in rest:
                obj = getattr(obj, part)
            obj = _installed.get(replaced.get(dotted), obj)  # once installed, check what we replaced
            if hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16] != digest:
                changed.append(dotted)
        except (AttributeError, OSError, TypeError):
            changed.append(dotted)
    return changed


def _reason_off() -> str | None:
    if os.environ.get("THUNDER_BATCH_FAST_TRACE", "1") == "0":
        return "THUNDER_BATCH_FAST_TRACE=0"
    changed = unverified_sources()
    if changed:
        return "source differs from the verified one: " + ", ".join(changed)
    return None


def status() -> str:
    """ "on" while installed; else "off: <why>" (not yet installed, turned off, or sources changed)."""
    if _installed:
        return "on"
    return f"off: {_off_reason[0]}" if _off_reason else "off: not installed"


def install() -> bool:
    """Install the shortcuts in Thunder's interpreter; False (nothing changed) when turned off or
    when Thunder/torch changed the code they stand in for."""
    if _installed:
        return True
    reason = _reason_off()
    if reason:
        if reason not in _off_reason:
            _off_reason[:] = [reason]
            logging.getLogger(__name__).warning("Thunder tracing speedups off (tracing ~2x slower): %s", reason)
        return False
    _off_reason.clear()
    from thunder.core import interpreter, jit_ext

    original = torch.nn.Module._call_impl
    # Same code under another function object: not in the lookaside map, so no recursion.
    interpreted_call_impl = types.FunctionType(
        original.__code__, original.__globals__, original.__name__, original.__defaults__, original.__closure__
    )

    def call_impl_lookaside(wrapped_self, *args, **kwargs):
        module = interpreter.unwrap(wrapped_self)
        if torch._C._get_tracing_state() or _has_hooks(module):
            return interpreter._interpret_call(interpreted_call_impl, wrapped_self, *args, **kwargs)
        return interpreter._interpret_call(_direct_forward, wrapped_self, *args, **kwargs)

    _installed.update(
        dis=interpreter.dis,
        lookaside=jit_ext._general_jit_lookaside_map.get(original),
        binary_subscr=interpreter._binary_subscr,
        globals_lookup=interpreter.globals_lookup,
        python_frame=interpreter.InterpreterFrame.get_or_make_python_frame,
    )
    jit_ext._general_jit_lookaside_map[original] = call_impl_lookaside
    interpreter.dis = _CachedDis()
    interpreter._binary_subscr = _fast_binary_subscr
    interpreter.globals_lookup = _fast_globals_lookup
    interpreter.InterpreterFrame.get_or_make_python_frame = _python_frame_without_spinning
    return True


def _dict_getitem(wrapped_dict, wrapped_key):
    """`wrapped_dict[wrapped_key]` as the interpreter would end up doing it, or None when the
    fast path does not apply (not a plain dict, or items not tracked)."""
    from thunder.core import interpreter

    ctx = interpreter.get_interpretercompilectx()
    if (
        type(wrapped_dict) is not interpreter.WrappedValue
        or type(wrapped_dict.value) is not dict
        or wrapped_dict.item_wrappers is None
        or not ctx._with_provenance_tracking
    ):
        return None
    return interpreter.MutMappingWrapperMethods.__getitem__(wrapped_dict, wrapped_key)


def _fast_binary_subscr(stack, tos1, tos):
    from thunder.core import interpreter

    res = _dict_getitem(tos1, tos)
    if res is None:
        return _installed["binary_subscr"](stack, tos1, tos)
    return interpreter.check_and_append(stack, res)


def _subscr(wrapped_dict, wrapped_key):
    from thunder.core import interpreter

    res = _dict_getitem(wrapped_dict, wrapped_key)
    return interpreter._interpret_call(lambda d, k: d[k], wrapped_dict, wrapped_key) if res is None else res


def _fast_globals_lookup(globals_dict, name):
    """thunder.core.interpreter.globals_lookup with its subscripts on the fast path."""
    from thunder.core import interpreter as I

    if I.unwrap(name) in I.unwrap(globals_dict):
        return _subscr(globals_dict, name)
    builtins = _subscr(globals_dict, I.wrap_const("__builtins__"))
    if builtins is I.INTERPRETER_SIGNALS.EXCEPTION_RAISED:
        return builtins
    if isinstance(I.unwrap(builtins), types.ModuleType):
        res = I._interpret_call(getattr, builtins, name)
        if res is I.INTERPRETER_SIGNALS.EXCEPTION_RAISED:
            return I.do_raise(NameError(f"name '{I.unwrap(name)}' is not defined"))
        return res
    res = _subscr(builtins, name)
    if res is I.INTERPRETER_SIGNALS.EXCEPTION_RAISED and isinstance(I.get_interpreterruntimectx()._curexc, KeyError):
        return I.do_raise(NameError(f"name '{I.unwrap(name)}' is not defined"))
    return res


def uninstall() -> None:
    if not _installed:
        return
    from thunder.core import interpreter, jit_ext

    interpreter.dis = _installed["dis"]
    interpreter._binary_subscr = _installed["binary_subscr"]
    interpreter.globals_lookup = _installed["globals_lookup"]
    interpreter.InterpreterFrame.get_or_make_python_frame = _installed["python_frame"]
    if _installed["lookaside"] is None:
        jit_ext._general_jit_lookaside_map.pop(torch.nn.Module._call_impl, None)
    else:
        jit_ext._general_jit_lookaside_map[torch.nn.Module._call_impl] = _installed["lookaside"]
    _installed.clear()
    _off_reason[:] = ["uninstalled"]


def _python_frame_without_spinning(self):
    """InterpreterFrame.get_or_make_python_frame, waiting on a lock instead of spinning."""
    import _thread

    lineno = self.positions.lineno if self.positions.lineno is not None else self.code.co_firstlineno
    code = self.code
    replacements = dict(co_filename=code.co_filename, co_firstlineno=code.co_firstlineno, co_name=code.co_name)
    if hasattr(code, "co_qualname"):
        replacements["co_qualname"] = self.qualname
    # Raising at the right line of a code object named like the frame yields a frame that says where we are.
    raiser = compile((lineno - code.co_firstlineno) * "\n" + "raise ValueError()", code.co_filename, "exec")
    result: list = []
    done = _thread.allocate_lock()
    done.acquire()

    def get_frame():  # in another thread, so that f_back is not the frame handling the error
        def fn():
            pass

        fn.__code__ = raiser.replace(**replacements)
        try:
            fn()
        except ValueError as e:
            tb = e.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            result.append(tb.tb_frame)
        finally:
            done.release()

    _thread.start_new_thread(get_frame, ())
    done.acquire()
    return result[0]
