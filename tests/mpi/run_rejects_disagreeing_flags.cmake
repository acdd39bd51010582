# tests/mpi/run_rejects_disagreeing_flags.cmake: `vpce run --backend mpi` where rank 1 alone
# has an extra flag must fail at once on every rank with one error line (from rank 0)
# naming that flag, and write nothing. Arguments: VPCE, MPIRUN (;-separated, ends with the
# rank-count flag), WRAPPER (rank_one_adds.sh), WORK_DIR.
cmake_minimum_required(VERSION 3.22)
include(${CMAKE_CURRENT_LIST_DIR}/fresh_inputs.cmake)
file(WRITE ${WORK_DIR}/in/one.txt "")
set(inputs --logits ${WORK_DIR}/in/logits.npy --targets ${WORK_DIR}/in/targets.npy)
# name; the flag the message must name; how many arguments rank 1 adds; the arguments
foreach(case "threads;--threads;2;--threads;1" "in-place;--in-place;1;--in-place" "extras;--extras;1;--extras"
             "grad-output;--grad-output;2;--grad-output;${WORK_DIR}/in/one.txt"
             "smoothing;--label-smoothing;2;--label-smoothing;0.1")
  list(POP_FRONT case name flag)
  string(TIMESTAMP start "%s")
  execute_process(COMMAND ${MPIRUN} 3 sh ${WRAPPER} ${case} ${VPCE} run --backend mpi ${inputs}
                          --out ${WORK_DIR}/out-${name}
                  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  string(TIMESTAMP end "%s")
  math(EXPR elapsed "${end} - ${start}")
  message(STATUS "${name}: exit ${result} after ${elapsed} s\n${err}")
  string(REGEX MATCHALL "vpce: error:[^\n]*" lines "${err}")
  list(LENGTH lines count)
  if(result EQUAL 0 OR result MATCHES "timeout")
    message(FATAL_ERROR "${name}: expected a failing exit status, got ${result}")
  endif()
  if(elapsed GREATER 60)
    message(FATAL_ERROR "${name}: expected an error at once, got one after ${elapsed} s")
  endif()
  if(NOT count EQUAL 1 OR NOT lines MATCHES "${flag}: expected the same value on every MPI rank")
    message(FATAL_ERROR "${name}: expected one error line naming ${flag}, got ${count}:\n${err}")
  endif()
  if(EXISTS ${WORK_DIR}/out-${name})
    message(FATAL_ERROR "${name}: an output directory was written")
  endif()
endforeach()
