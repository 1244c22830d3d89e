#!/usr/bin/env bash
# Set up a fresh machine: OpenMPI from the OS packages, then msdist with its test and tool extras.
set -euo pipefail
if ! command -v mpirun >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq openmpi-bin >/dev/null
fi
python3 -m pip install -q -e ".[test,tensorboard,report]"
