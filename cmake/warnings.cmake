# warnings.cmake: the warning flags of vpce's own code, on an interface target rather than
# global flags, so that consumers and third-party code are not affected.
add_library(vpce_warnings INTERFACE)
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_compile_options(vpce_warnings INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast -Wcast-align
    -Wnull-dereference -Wdouble-promotion -Wimplicit-fallthrough>)
endif()
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  # GCC 12 reports -Wrestrict for "literal" + std::string at -O2 (GCC bug 105651).
  target_compile_options(vpce_warnings INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Wno-restrict>)
endif()
# vpce's CUDA code compiles in CI where no GPU runs it: nvcc's warnings fail the build (a
# narrowing warning once found an aggregate filling the wrong field).
target_compile_options(vpce_warnings INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:--Werror=all-warnings>)
install(TARGETS vpce_warnings EXPORT vpceTargets)
