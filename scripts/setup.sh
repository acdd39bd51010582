#!/usr/bin/env bash
# Installs what building and testing vpce needs on Debian 12 (as root, or through sudo).
# Does nothing when everything is already there.
set -euo pipefail
# ocl-icd-opencl-dev: libdnnl-dev only recommends it, but oneDNN's CMake config fails
# without OpenCL's library and headers, and the install skips recommendations.
packages=(g++ cmake make libgtest-dev libbenchmark-dev libcli11-dev libdlpack-dev libxxhash-dev libhwy-dev libdnnl-dev ocl-icd-opencl-dev python3-torch clang clang-format libclang-rt-14-dev
  libopenmpi-dev openmpi-bin libmpich-dev mpich python3-venv python3-pip python3-pytest)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
