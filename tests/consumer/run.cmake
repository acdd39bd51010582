# Installs the vpce build at BUILD_DIR into a fresh prefix under WORK_DIR, then configures,
# builds and runs tests/consumer against it with find_package(vpce). Fails on any error.
file(REMOVE_RECURSE ${WORK_DIR})
foreach(step
    "${CMAKE_COMMAND};--install;${BUILD_DIR};--prefix;${WORK_DIR}/prefix"
    "${CMAKE_COMMAND};-S;${SOURCE_DIR};-B;${WORK_DIR}/build;-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix;-DCMAKE_BUILD_TYPE=Release"
    "${CMAKE_COMMAND};--build;${WORK_DIR}/build"
    "${WORK_DIR}/build/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "${out}")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "step failed (${result}): ${step}\n${out}\n${err}")
  endif()
endforeach()

# With the MPI backend: the MPI example, built on its own against the installed vpce::mpi.
if(EXAMPLE_DIR)
  foreach(step
      "${CMAKE_COMMAND};-S;${EXAMPLE_DIR};-B;${WORK_DIR}/example;-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix;-DCMAKE_BUILD_TYPE=Release"
      "${CMAKE_COMMAND};--build;${WORK_DIR}/example")
    execute_process(COMMAND ${step} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
    message(STATUS "${out}")
    if(NOT result EQUAL 0)
      message(FATAL_ERROR "step failed (${result}): ${step}\n${out}\n${err}")
    endif()
  endforeach()
endif()
