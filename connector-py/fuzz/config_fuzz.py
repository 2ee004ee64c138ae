"""Coverage-guided fuzzing of the connector's settings parser (``kvd/config.py``), which reads
the operator's ``kv_connector_extra_config`` — JSON that vLLM hands over as a dict.

The contract checked: any dict of JSON-like values (Python's json also yields NaN and ±inf)
either gives a ``KvdConfig`` whose fields have their declared types and usable values (timeouts
finite and above zero, reconnect_min_s <= reconnect_max_s, events and chunk_tokens >= 1), or
raises ``ValueError`` with one line that names the key. Any other exception is a defect.

Run under atheris (libFuzzer for Python, a wheel on PyPI)::

    python connector-py/fuzz/config_fuzz.py CORPUS_DIR -atheris_runs=10000000 -rss_limit_mb=2048

``connector-py/tests/test_config_fuzz.py`` replays the committed corpus and the regressions
through :func:`check` without atheris. config.py is loaded by path, so neither needs the native
module.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

_CONFIG_PY = Path(__file__).resolve().parent.parent / "python" / "kvd" / "config.py"


def _load_config_module() -> Any:
    spec = importlib.util.spec_from_file_location("kvd_config_under_fuzz", _CONFIG_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


config = _load_config_module()

_FIELDS = [f.name for f in config.fields(config.KvdConfig)]
_SECONDS = [n for n in _FIELDS if n.endswith("_s")]
_STRINGS = ["true", "false", "on", "0", "1", "-1", "nan", "inf", "-inf", "1e400", "2.5", "", "none",
            "tcp://127.0.0.1:5555", "ipc:///tmp/kvd.sock", "BLNHC", "9" * 5000, "\n", "é"]
_FLOATS = [0.0, -0.0, -1.0, 1e-300, 1e308, math.inf, -math.inf, math.nan, 0.5, 3.0]


class _Input:
    """Takes values from the fuzzer's bytes; past the end every read is 0 or empty."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            return 0
        self.at += 1
        return self.data[self.at - 1]

    def int(self, nbytes: int) -> int:
        return int.from_bytes(bytes(self.byte() for _ in range(nbytes)), "little", signed=True)

    def text(self) -> str:
        n = self.byte()
        raw = self.data[self.at:self.at + n]
        self.at += n
        return raw.decode("utf-8", "replace")


def _value(inp: _Input, depth: int = 0) -> Any:
    kind = inp.byte() % 10
    if kind == 0:
        return _STRINGS[inp.byte() % len(_STRINGS)]
    if kind == 1:
        return inp.text()
    if kind == 2:
        return inp.int(1 + inp.byte() % 16) * (10 ** (inp.byte() % 40))
    if kind == 3:
        return _FLOATS[inp.byte() % len(_FLOATS)]
    if kind == 4:
        return float(inp.int(8)) / (1 + inp.byte())
    if kind == 5:
        return bool(inp.byte() & 1)
    if kind == 6:
        return None
    if kind == 7 and depth < 3:
        return [_value(inp, depth + 1) for _ in range(inp.byte() % 4)]
    if kind == 8 and depth < 3:
        return {inp.text(): _value(inp, depth + 1) for _ in range(inp.byte() % 4)}
    return inp.int(2)


def _key(inp: _Input) -> str:
    kind = inp.byte() % 6
    name = _FIELDS[inp.byte() % len(_FIELDS)]
    if kind == 0:
        return "kvd." + name
    if kind == 1:
        return name
    if kind == 2:
        return "kvd." + name.replace("_", "-")
    if kind == 3:
        return "kvd." + inp.text()
    if kind == 4:
        return inp.text()
    return "kvd." + name[: inp.byte() % (len(name) + 1)]


def extra_config(data: bytes) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` dict the fuzzer's bytes describe."""
    inp = _Input(data)
    return {_key(inp): _value(inp) for _ in range(inp.byte() % 8)}


def check(data: bytes) -> None:
    """Parses the dict ``data`` describes; raises AssertionError where the contract breaks."""
    extra = extra_config(data)
    try:
        cfg = config.KvdConfig.from_extra_config(extra)
    except ValueError as e:
        message = str(e)
        assert "\n" not in message, f"a multi-line error: {message!r}"
        assert len(message) < 1000, f"an error of {len(message)} characters"
        assert any(repr(k)[:40] in message for k in extra), \
            f"the error names no key of {extra!r}: {message}"
        return
    for f in config.fields(cfg):
        v = getattr(cfg, f.name)
        t = str(f.type)
        if "bool" in t:
            assert isinstance(v, bool), (f.name, v)
        elif "float" in t:
            assert isinstance(v, float) and math.isfinite(v) and v > 0, (f.name, v, extra)
        elif f.name == "sync_load_tokens":
            # A budget may be 0 (every hit asynchronously) or absent (no limit).
            assert v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0), (f.name, v, extra)
        elif "int" in t:
            assert isinstance(v, int) and not isinstance(v, bool) and v >= 1, (f.name, v, extra)
        elif "None" in t:
            assert v is None or isinstance(v, str), (f.name, v)
        else:
            assert isinstance(v, str), (f.name, v)
    assert cfg.reconnect_min_s <= cfg.reconnect_max_s, (cfg, extra)


def main() -> None:
    import atheris

    for fn in vars(config).values():
        if callable(fn) and getattr(fn, "__module__", None) == config.__name__:
            if isinstance(fn, type):
                for attr in vars(fn).values():
                    code_owner = getattr(attr, "__func__", attr)
                    if hasattr(code_owner, "__code__"):
                        atheris.instrument_func(code_owner)
            elif hasattr(fn, "__code__"):
                atheris.instrument_func(fn)
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
