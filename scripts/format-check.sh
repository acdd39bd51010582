#!/usr/bin/env bash
# Every C++ and CUDA file git tracks is as .clang-format writes it (clang-format 14, Debian 12's);
# fails naming the files that are not. Fix with: git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i
set -euo pipefail
cd "$(dirname "$0")/.."
clang_format=${CLANG_FORMAT:-clang-format}
git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs "$clang_format" --dry-run -Werror --style=file
