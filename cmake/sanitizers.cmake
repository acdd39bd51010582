# sanitizers.cmake: VPCE_SANITIZE=address,undefined or VPCE_SANITIZE=thread builds every
# target (library, tools, tests) with those sanitizers, failing on the first report.
set(VPCE_SANITIZE "" CACHE STRING "Sanitizers for every target: address,undefined or thread")
if(VPCE_SANITIZE)
  add_compile_options(-fsanitize=${VPCE_SANITIZE} -fno-omit-frame-pointer -g)
  add_link_options(-fsanitize=${VPCE_SANITIZE})
  if(VPCE_SANITIZE MATCHES "undefined")
    add_compile_options(-fno-sanitize-recover=undefined)
  endif()
  if(VPCE_SANITIZE MATCHES "thread" AND VPCE_WITH_OPENMP)
    message(FATAL_ERROR "VPCE_SANITIZE=thread needs VPCE_WITH_OPENMP=OFF: libgomp is not "
                        "instrumented, so ThreadSanitizer would report its internals")
  endif()
endif()

# VPCE_BUILD_FUZZERS: libFuzzer targets in fuzz/, with every target compiled for coverage.
option(VPCE_BUILD_FUZZERS "Build the libFuzzer targets in fuzz/ (needs clang)" OFF)
if(VPCE_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "VPCE_BUILD_FUZZERS needs clang (libFuzzer); configure with CMAKE_CXX_COMPILER=clang++")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link)
  # UBSan in the SIMD kernels' files takes clang over 10 minutes to compile (3 without it);
  # scripts/sanitize.sh's suite keeps it there, so the fuzz build leaves those files without.
  if(VPCE_SANITIZE MATCHES "undefined")
    set_source_files_properties(${PROJECT_SOURCE_DIR}/src/cpu/simd_stats.cc ${PROJECT_SOURCE_DIR}/src/cpu/simd_gradient.cc
                                ${PROJECT_SOURCE_DIR}/src/cpu/simd_rows.cc PROPERTIES COMPILE_OPTIONS -fno-sanitize=undefined)
  endif()
endif()
