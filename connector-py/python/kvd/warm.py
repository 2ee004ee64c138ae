"""Warms a replacement vLLM engine from kvd before it takes traffic:
``python -m kvd.warm --group NAME --engine http://HOST:PORT``.

A restarted engine starts with an empty GPU prefix cache. Its conversations' next turns then
all load their prefixes from kvd in the same few steps, and that first turn is slower than the
engine's steady state (2.3-2.6x on an H100, benches/RESULTS.md). A replica whose connector
names itself (``kv_connector_extra_config`` ``"kvd.warm_group": NAME``, the same name across
its restarts) has every prompt it finishes remembered in kvd (``kvd serve --recall-mb``). This
tool, run between the replacement's start and its readiness (a Kubernetes startup probe, a
rollout script), asks kvd for the group's newest prompts and sends each to the engine: each is
a kvd hit, so the engine loads the prefixes before traffic returns and its first turns are GPU
prefix-cache hits. Each asks for one token (``--output-tokens``: more also run decode steps
with the warm's batch; on an H200 a two-token warm did not shorten the replacement's first turn,
benches/results/2026-12-07-session-33.md). The requests carry ``kv_transfer_params``
``{"kvd.warm": true}``, so that the replacement does not remember them again as new prompts.

Prints one line and exits 0 once every prompt chosen was answered (an empty group warms nothing
and is not an error); prints what failed and the likely fix and exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvd import _native


#: The ``kv_transfer_params`` key that marks a request as a warm's replay (the connector does not
#: remember such a prompt again).
WARM_PARAM = "kvd.warm"

#: Tokens each replayed prompt generates by default: the first is what loads its prefix; more
#: run decode steps with the warm's batch, which did not shorten the first turn (the module's text).
OUTPUT_TOKENS = 1


class WarmFailed(Exception):
    """A step of the warm failed; the message says which and what to look at."""


@dataclass(frozen=True)
class Prompt:
    """A prompt kvd remembered."""

    tokens: list[int]
    #: The request's cache_salt ("" for none).
    salt: str
    #: Seconds since kvd remembered it.
    age_s: float


def recall(url: str, group: str, max_prompts: int = 64, max_tokens: int | None = None,
           max_age_s: float | None = None, timeout_s: float = 5.0) -> list[Prompt]:
    """The newest prompts the group holds, newest first: at most ``max_prompts``, together at
    most ``max_tokens`` tokens (what the engine's GPU cache should take; None: no limit), none
    older than ``max_age_s``. A prompt that another chosen one extends is left out (it is the
    same conversation's earlier turn: warming the later one loads it too)."""
    try:
        client = _native.Client(url, "kvd.warm", role="tool", connect_timeout=timeout_s,
                                request_timeout=timeout_s)
    except _native.ConnectionLost as e:
        raise WarmFailed(f"{e}: is `kvd serve` running there, with that --host and --port (or --ipc path)?") from e
    except (ValueError, _native.KvdError) as e:
        raise WarmFailed(f"cannot connect to kvd at {url}: {e}") from e
    chosen: list[Prompt] = []
    total = 0
    index = 0
    while len(chosen) < max_prompts:
        try:
            prompt, _held = client.recall(group, index).result(timeout_s)
        except _native.KvdError as e:
            older = " (this kvd predates Recall: upgrade it)" if "unknown message kind" in str(e) else ""
            raise WarmFailed(f"kvd at {url} did not answer a recall of group {group!r}: "
                             f"{type(e).__name__}: {e}{older}") from e
        index += 1
        if prompt is None:
            break
        salt, tokens, age_ms = prompt
        if max_age_s is not None and age_ms / 1e3 > max_age_s:
            break  # the rest are older still
        if any(c.salt == salt and c.tokens[:len(tokens)] == tokens for c in chosen):
            continue
        if max_tokens is not None and total + len(tokens) > max_tokens:
            continue  # a shorter, older one may still fit
        chosen.append(Prompt(list(tokens), salt, age_ms / 1e3))
        total += len(tokens)
    return chosen


@dataclass
class Warmed:
    """What a warm did."""

    prompts: int
    tokens: int
    seconds: float


def warm(prompts: Sequence[Prompt], submit: Callable[[Prompt], None], concurrency: int = 8) -> Warmed:
    """Sends every prompt through ``submit`` (which returns once the engine has answered it),
    ``concurrency`` at a time, the oldest first: should the engine's GPU cache not take them
    all, the newest are the ones it keeps. The first failure is raised once all have run."""
    t0 = time.monotonic()
    ordered = list(reversed(prompts))
    errors: list[BaseException] = []

    def one(p: Prompt) -> None:
        try:
            submit(p)
        except BaseException as e:  # noqa: BLE001 - reported after the rest have run
            errors.append(e)

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        list(pool.map(one, ordered))
    if errors:
        raise errors[0]
    return Warmed(len(ordered), sum(len(p.tokens) for p in ordered), time.monotonic() - t0)


def _get_json(url: str, timeout_s: float, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace")
        raise WarmFailed(f"{url}: HTTP {e.code}: {detail}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise WarmFailed(f"{url}: {e}: is the engine up (`vllm serve`), at that address?") from e
    if not isinstance(answer, dict):
        raise WarmFailed(f"{url}: answered {str(answer)[:80]!r}, not a JSON object: is it vLLM's OpenAI server?")
    return answer



def engine_model(engine: str, timeout_s: float) -> str:
    """The model an OpenAI-compatible engine serves (the first of ``/v1/models``)."""
    models = _get_json(engine.rstrip("/") + "/v1/models", timeout_s).get("data")
    try:
        return str(models[0]["id"])  # type: ignore[index]
    except (IndexError, KeyError, TypeError) as e:
        raise WarmFailed(f"{engine}/v1/models lists no model id ({str(models)[:80]}): pass --model") from e


def http_submit(engine: str, model: str, timeout_s: float, output_tokens: int = OUTPUT_TOKENS) -> Callable[[Prompt], None]:
    """A ``submit`` for ``warm`` over an OpenAI-compatible engine: the prompt's token ids to
    ``/v1/completions`` with ``max_tokens`` ``output_tokens``, its ``cache_salt``, and
    ``kv_transfer_params`` marking it a warm (the connector does not remember it again)."""
    url = engine.rstrip("/") + "/v1/completions"

    def submit(p: Prompt) -> None:
        _get_json(url, timeout_s, completion_body(model, p, output_tokens))

    return submit


def completion_body(model: str, p: Prompt, output_tokens: int = OUTPUT_TOKENS) -> dict[str, Any]:
    """The ``/v1/completions`` body that replays ``p``: its token ids, greedy, ``output_tokens``
    tokens whatever they are (``ignore_eos``: with more than one, an end-of-sequence token first
    would skip the decode steps asked for), its ``cache_salt``, and ``kv_transfer_params``
    marking it a warm's."""
    body: dict[str, Any] = {"model": model, "prompt": p.tokens, "max_tokens": output_tokens, "temperature": 0.0,
                            "ignore_eos": True, "kv_transfer_params": {WARM_PARAM: True}}
    if p.salt:
        body["cache_salt"] = p.salt
    return body


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m kvd.warm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="tcp://127.0.0.1:5555",
                    help="kvd's ZMQ endpoint, tcp://HOST:PORT or ipc://PATH (default: %(default)s)")
    ap.add_argument("--group", required=True, help="the replica's name: its connector's kvd.warm_group")
    ap.add_argument("--engine", required=True, help="the engine's OpenAI-compatible address, http://HOST:PORT")
    ap.add_argument("--model", help="the served model name (default: the first of /v1/models)")
    ap.add_argument("--max-prompts", type=int, default=64, help="newest prompts to replay (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int,
                    help="most tokens in all: keep it under the engine's GPU KV cache (vLLM logs its size "
                         "at start, 'GPU KV cache size: N tokens'; default: no limit)")
    ap.add_argument("--max-age", type=float, metavar="S", help="skip prompts remembered more than S seconds ago")
    ap.add_argument("--concurrency", type=int, default=8, help="prompts in flight (default: %(default)s)")
    ap.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS,
                    help="tokens each prompt generates: 1 loads the prefix; more also run decode steps with "
                         "the warm's batch (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=60.0, metavar="S",
                    help="seconds for kvd's answers and for each prompt (default: %(default)s)")
    args = ap.parse_args(argv)
    if not args.url.startswith(("tcp://", "ipc://")):
        ap.error(f"--url {args.url}: expected tcp://HOST:PORT or ipc://PATH")
    if args.max_prompts < 1 or args.concurrency < 1 or args.output_tokens < 1:
        ap.error("--max-prompts, --concurrency and --output-tokens must be 1 or more")
    try:
        model = args.model or engine_model(args.engine, args.timeout)
        prompts = recall(args.url, args.group, args.max_prompts, args.max_tokens, args.max_age,
                         min(args.timeout, 10.0))
        done = warm(prompts, http_submit(args.engine, model, args.timeout, args.output_tokens), args.concurrency)
    except WarmFailed as e:
        print(f"kvd.warm: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"kvd.warm: ok: {done.prompts} prompts of group {args.group!r} ({done.tokens} tokens) sent to "
          f"{args.engine} ({model}) in {done.seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
