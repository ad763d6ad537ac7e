#!/usr/bin/env bash
# Setup for tests/test_triton.py and tests/test_cpp_contract.py (idempotent; run after `pip install -e ".[dev]"`).
set -euo pipefail

# C++ contract: g++ and the header-only nlohmann-json.
if ! command -v g++ >/dev/null 2>&1 || [ ! -f /usr/include/nlohmann/json.hpp ]; then
  apt-get update -qq && apt-get install -y -qq g++ nlohmann-json3-dev
fi

# Triton: the tritonserver binary (2.51, Python backend) ships inside nvidia-pytriton. --no-deps keeps the
# environment's numpy 2: the package pins numpy<2 for its own Python API, which is not used here.
if ! python -m pip show nvidia-pytriton >/dev/null 2>&1; then
  python -m pip install --quiet --disable-pip-version-check --no-deps "nvidia-pytriton==0.7.0"
fi

# The backend stub needs numpy<2 in a folder of its own (see medusa_export/triton/local.py); filled once.
python -c "from medusa_export.triton.local import stub_site; print('triton stub numpy site:', stub_site() or 'not needed')"
