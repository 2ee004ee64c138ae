#!/usr/bin/env python3
"""Runs a Dockerfile's build steps on this machine, for hosts where Docker cannot run, so that
the Dockerfile itself is what gets tested rather than a copy of its commands.

    deploy/docker/build-steps.py [--build-arg NAME=VALUE ...] [--cache-dir DIR] OUT

Each stage gets a directory OUT/stages/NAME standing in for its filesystem: `COPY` copies the
build context (less what .dockerignore excludes) or another stage's files into it, `WORKDIR` and
`ENV` set where and with what `RUN` runs, and `RUN --mount=type=cache,target=T` links T to a
directory under --cache-dir that outlives the run, as BuildKit's cache mounts do. The last
stage's files are OUT/rootfs and its configuration (ENTRYPOINT, CMD, HEALTHCHECK, EXPOSE, ...)
OUT/image.json.

What it cannot do, and so does not check: pull base images (`RUN` uses this host's tools, and
`COPY --from` the builder takes a file of its base image, such as the CA bundle, from this host,
so the host needs what the base image provides: here cargo at the pinned toolchain, bash,
ca-certificates), run `RUN` steps in a stage with a base other than the builder's (it refuses
them), isolate `RUN` from the host (commands must use paths relative to WORKDIR, and the host's
CARGO_TARGET_DIR is left out), or apply ownership (`--chown` is ignored).
An instruction it does not know is an error, so a Dockerfile it cannot follow fails loudly.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METADATA = {"EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD", "LABEL", "USER", "STOPSIGNAL"}
# Host variables a `RUN` does not get: cargo would write outside the stage.
HOST_ONLY = {"CARGO_TARGET_DIR", "CARGO_BUILD_TARGET_DIR"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    if pending:
        raise SystemExit("Dockerfile ends inside a continued line")
    return out


def substitute(text: str, env: dict[str, str]) -> str:
    """${NAME} and $NAME from build arguments, as Docker expands them in instructions."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)


def ignored(rel: str, patterns: list[str]) -> bool:
    verdict = False
    for p in patterns:
        negate = p.startswith("!")
        pat = p[1:] if negate else p
        pat = pat.strip("/")
        if pat.startswith("**/"):
            hit = fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel, pat[3:]) or fnmatch.fnmatch(Path(rel).name, pat[3:])
        else:
            hit = fnmatch.fnmatch(rel, pat) or any(fnmatch.fnmatch(part, pat) for part in _prefixes(rel))
        if hit:
            verdict = not negate
    return verdict


def _prefixes(rel: str) -> list[str]:
    parts = rel.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def copy_context(context: Path, dest: Path) -> None:
    patterns = []
    ignore_file = context / ".dockerignore"
    if ignore_file.exists():
        patterns = [line.strip() for line in ignore_file.read_text().splitlines() if line.strip() and not line.startswith("#")]
    for dirpath, dirnames, filenames in os.walk(context):
        rel_dir = Path(dirpath).relative_to(context).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if not ignored(rel_dir + d, patterns)]
        for f in filenames:
            rel = rel_dir + f
            if ignored(rel, patterns):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(dirpath) / f, target, follow_symlinks=False)


def inside(stage: Path, path: str, workdir: str) -> Path:
    """A container path inside a stage's directory."""
    absolute = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    return stage / absolute.lstrip("/")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--file", type=Path, default=ROOT / "deploy/docker/Dockerfile")
    ap.add_argument("--context", type=Path, default=ROOT)
    ap.add_argument("--build-arg", action="append", default=[])
    ap.add_argument("--cache-dir", type=Path, default=None)
    a = ap.parse_args()
    out: Path = a.out.resolve()
    cache = (a.cache_dir or out / "cache").resolve()
    overrides = dict(kv.split("=", 1) for kv in a.build_arg)
    shutil.rmtree(out / "stages", ignore_errors=True)
    shutil.rmtree(out / "rootfs", ignore_errors=True)
    stages: dict[str, Path] = {}
    bases: dict[str, str] = {}
    global_args: dict[str, str] = {}
    stage: Path | None = None
    stage_args: dict[str, str] = {}
    env: dict[str, str] = {}
    workdir = "/"
    config: dict[str, object] = {}
    builder_base: str | None = None
    base = ""
    for word, rest in instructions(a.file.read_text()):
        if word == "ARG":
            name, _, default = rest.partition("=")
            value = overrides.get(name, substitute(default, {**global_args, **stage_args}))
            (stage_args if stage else global_args)[name] = value
        elif word == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", substitute(rest, global_args), re.IGNORECASE)
            if not m:
                raise SystemExit(f"FROM {rest}: expected IMAGE [AS NAME]")
            base = m.group(1)
            name = m.group(2) or f"stage{len(stages)}"
            stage = out / "stages" / name
            stage.mkdir(parents=True)
            stages[name] = stage
            bases[name] = base
            stage_args, env, workdir, config = {}, {}, "/", {"base": base}
            print(f"== stage {name} (base {base}: not pulled; RUN uses this host's tools)", flush=True)
        elif stage is None:
            raise SystemExit(f"{word} before FROM")
        elif word == "WORKDIR":
            workdir = substitute(rest, {**stage_args, **env})
            inside(stage, workdir, "/").mkdir(parents=True, exist_ok=True)
        elif word == "ENV":
            name, _, value = rest.partition("=")
            env[name.strip()] = substitute(value.strip().strip('"'), {**stage_args, **env})
        elif word == "COPY":
            words = shlex.split(rest)
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            src_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            if any(not (f.startswith("--from=") or f.startswith("--chown=")) for f in flags):
                raise SystemExit(f"COPY {rest}: only --from and --chown are supported")
            *sources, dest = paths
            for src in sources:
                dest_path = inside(stage, dest, workdir)
                if src_stage is None:
                    if src != ".":
                        raise SystemExit(f"COPY {src}: only `COPY . DEST` from the context is supported")
                    copy_context(a.context, dest_path)
                else:
                    origin = inside(stages[src_stage], src, "/")
                    if not origin.exists() and src.startswith("/") and bases[src_stage] == builder_base:
                        # A file of the builder's base image: this host stands in for it, as it
                        # does for RUN.
                        origin = Path(src)
                        print(f"COPY {src}: from this host, standing in for {builder_base}", flush=True)
                    if origin.is_dir():
                        shutil.copytree(origin, dest_path, dirs_exist_ok=True, symlinks=True)
                    else:
                        dest_path.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(origin, dest_path)
            print(f"COPY {rest}", flush=True)
        elif word == "RUN":
            if builder_base is None:
                builder_base = base
            elif base != builder_base:
                raise SystemExit(f"RUN in a stage based on {base}: only the first stage's base ({builder_base}) is stood in for")
            command = rest
            links: list[Path] = []
            while command.startswith("--mount="):
                mount, _, command = command.partition(" ")
                opts = dict(o.split("=", 1) for o in mount[len("--mount="):].split(","))
                if opts.get("type") != "cache":
                    raise SystemExit(f"RUN {mount}: only cache mounts are supported")
                link = inside(stage, opts["target"], workdir)
                keep = cache / opts["target"].strip("/").replace("/", "_")
                keep.mkdir(parents=True, exist_ok=True)
                link.parent.mkdir(parents=True, exist_ok=True)
                if link.is_symlink() or link.exists():
                    raise SystemExit(f"cache mount {opts['target']} would hide files already there")
                link.symlink_to(keep)
                links.append(link)
                command = command.lstrip()
            print(f"RUN {command}", flush=True)
            # The host's environment stands in for the base image's, less what would send the
            # build's output outside the stage: a Docker build never sees the host's
            # CARGO_TARGET_DIR, and the Dockerfile copies from the stage's own target/.
            host = {k: v for k, v in os.environ.items() if k not in HOST_ONLY}
            run_env = {**host, **stage_args, **env}
            subprocess.run(["bash", "-ec", command], cwd=inside(stage, workdir, "/"), env=run_env, check=True)
            # Cache mounts are not part of the image.
            for link in links:
                link.unlink()
        elif word in METADATA:
            # Docker expands variables in these at build time, but not in HEALTHCHECK, CMD or
            # ENTRYPOINT: their shells do at run time.
            expand = word in {"EXPOSE", "LABEL", "USER", "STOPSIGNAL"}
            config[word.lower()] = substitute(rest, {**stage_args, **env}) if expand else rest
        else:
            raise SystemExit(f"unsupported instruction {word}")
    if stage is None:
        raise SystemExit("no FROM in the Dockerfile")
    shutil.copytree(stage, out / "rootfs", symlinks=True)
    for key in ("entrypoint", "cmd"):
        if key in config:
            config[key] = json.loads(str(config[key]))
    (out / "image.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"== image: {out / 'rootfs'}, config {out / 'image.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
