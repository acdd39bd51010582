# tests/mpi/run_rejects_bad_input.cmake: `vpce run --backend mpi` with a bad input must fail
# on every rank with one error line (from rank 0) and write nothing. Arguments: VPCE,
# MPIRUN (;-separated, ends with the rank-count flag), WORK_DIR.
cmake_minimum_required(VERSION 3.22)
include(${CMAKE_CURRENT_LIST_DIR}/fresh_inputs.cmake)
set(logits --logits ${WORK_DIR}/in/logits.npy)
set(targets --targets ${WORK_DIR}/in/targets.npy)
foreach(case "missing;--targets;${WORK_DIR}/in/none.npy" "splits;${targets};--vocab-splits;10,40")
  list(POP_FRONT case name)
  execute_process(COMMAND ${MPIRUN} 3 ${VPCE} run --backend mpi ${logits} ${case} --out ${WORK_DIR}/out-${name}
                  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  message(STATUS "${name}: exit ${result}\n${err}")
  string(REGEX MATCHALL "vpce: error:" lines "${err}")
  list(LENGTH lines count)
  if(result EQUAL 0 OR result MATCHES "timeout")
    message(FATAL_ERROR "${name}: expected a failing exit status, got ${result}")
  endif()
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "${name}: expected one error line, got ${count}:\n${err}")
  endif()
  if(EXISTS ${WORK_DIR}/out-${name})
    message(FATAL_ERROR "${name}: an output directory was written")
  endif()
endforeach()
