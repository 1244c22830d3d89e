#!/usr/bin/env bash
# Set up a fresh machine: OpenMPI and iproute2 from the OS packages, then msdist with its test and tool extras.
set -euo pipefail
# iproute2 (`ip`): the two-host tests build network namespaces with it (tests/integration/test_two_hosts.py).
PACKAGES=()
command -v mpirun >/dev/null 2>&1 || PACKAGES+=(openmpi-bin)
command -v ip >/dev/null 2>&1 || PACKAGES+=(iproute2)
if [ ${#PACKAGES[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
fi
python3 -m pip install -q -e ".[test,tensorboard,report]"
