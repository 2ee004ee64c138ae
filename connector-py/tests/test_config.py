"""The settings parser: regressions the fuzzer found (connector-py/fuzz/config_fuzz.py), and the
replay of its corpus, so CI checks what it learnt without atheris."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from kvd.config import KvdConfig

FUZZ = Path(__file__).resolve().parent.parent / "fuzz"


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("config_fuzz", FUZZ / "config_fuzz.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_and_typed_values_parse():
    cfg = KvdConfig.from_extra_config({"kvd.url": "ipc:///tmp/k.sock", "kvd.events": "8", "kvd.store": "off",
                                       "kvd.load-timeout-s": 5, "other_connector.key": 1})
    assert (cfg.url, cfg.events, cfg.store, cfg.load_timeout_s) == ("ipc:///tmp/k.sock", 8, False, 5.0)
    assert KvdConfig.from_extra_config(None) == KvdConfig()


@pytest.mark.parametrize("value", [0, -1, False, math.nan, math.inf, "nan", "-2.5"])
def test_a_timeout_that_is_not_a_positive_finite_number_is_refused(value):
    # Found by the fuzzer: {"load_timeout_s": false} gave a 0 s load timeout.
    with pytest.raises(ValueError, match="kvd.load_timeout_s.*positive number of seconds"):
        KvdConfig.from_extra_config({"kvd.load_timeout_s": value})


@pytest.mark.parametrize("value", [math.inf, -math.inf, 1e400])
def test_an_infinite_count_is_a_value_error_not_an_overflow(value):
    # int(inf) raises OverflowError, which escaped the parser.
    with pytest.raises(ValueError, match="kvd.events"):
        KvdConfig.from_extra_config({"kvd.events": value})


@pytest.mark.parametrize("key", ["kvd.events", "kvd.chunk_tokens"])
def test_counts_below_one_are_refused(key):
    with pytest.raises(ValueError, match="1 or more"):
        KvdConfig.from_extra_config({key: 0})


def test_the_sync_load_budget_may_be_zero_but_not_negative():
    assert KvdConfig().sync_load_tokens is None, "no limit by default"
    assert KvdConfig.from_extra_config({"kvd.sync_load_tokens": 0}).sync_load_tokens == 0
    assert KvdConfig.from_extra_config({"kvd.sync_load_tokens": "8192"}).sync_load_tokens == 8192
    with pytest.raises(ValueError, match=r"kvd.sync_load_tokens.*-1 must be 0 \(every hit asynchronously\) or more"):
        KvdConfig.from_extra_config({"kvd.sync_load_tokens": -1})


def test_null_for_a_required_string_is_refused():
    # Found by the fuzzer: {"kvd.url": null} gave url None.
    with pytest.raises(ValueError, match="kvd.url"):
        KvdConfig.from_extra_config({"kvd.url": None})
    assert KvdConfig.from_extra_config({"kvd.fd_socket": None}).fd_socket is None


def test_reconnect_waits_must_be_ordered():
    with pytest.raises(ValueError, match="reconnect_min_s 60.0 is above reconnect_max_s 30.0"):
        KvdConfig.from_extra_config({"kvd.reconnect_min_s": 60})


def test_errors_about_huge_keys_and_values_stay_one_short_line():
    # Found by the fuzzer: an unknown key of NUL bytes made a 1,227-character error.
    for extra in ({"kvd." + "\0" * 300: 1}, {"kvd.events": "x" * 10_000}):
        with pytest.raises(ValueError) as e:
            KvdConfig.from_extra_config(extra)
        assert "\n" not in str(e.value) and len(str(e.value)) < 1000


def test_the_fuzz_corpus_and_regressions_replay():
    fuzz = _fuzz_module()
    corpus = sorted((FUZZ / "corpus" / "config").iterdir())
    regressions = sorted((FUZZ / "regressions" / "config").iterdir())
    assert len(corpus) >= 10 and len(regressions) >= 3
    for path in corpus + regressions:
        fuzz.check(path.read_bytes())
