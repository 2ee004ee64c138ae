#!/usr/bin/env bash
# Prints cargo's target directory for this workspace, as cargo resolves it (CARGO_TARGET_DIR,
# build.target-dir in a cargo config, else target/ here), so that scripts find what cargo
# built wherever that is.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo metadata --format-version 1 --no-deps --offline \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])'
