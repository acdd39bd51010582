# tests/mpi/run_stopped_rank_times_out.cmake: `vpce run --backend mpi --timeout 2` where rank
# 1 stops itself (SIGSTOP) right after MPI_Init: the other ranks must report the timeout
# and end the job within seconds, not wait (or spin) forever. Arguments: VPCE, MPIRUN
# (;-separated, ends with the rank-count flag), WRAPPER (stop_rank_one.sh), PRELOAD (the
# stop_after_init library), WORK_DIR.
cmake_minimum_required(VERSION 3.22)
include(${CMAKE_CURRENT_LIST_DIR}/fresh_inputs.cmake)
string(TIMESTAMP start "%s")
execute_process(COMMAND ${MPIRUN} 3 sh ${WRAPPER} ${PRELOAD} ${VPCE} run --backend mpi --timeout 2
                        --logits ${WORK_DIR}/in/logits.npy --targets ${WORK_DIR}/in/targets.npy --out ${WORK_DIR}/out
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 90)
string(TIMESTAMP end "%s")
math(EXPR elapsed "${end} - ${start}")
message(STATUS "exit ${result} after ${elapsed} s\n${err}")
if(result EQUAL 0 OR result MATCHES "timeout" OR elapsed GREATER 60)
  message(FATAL_ERROR "expected the job to fail within 60 s, got exit ${result} after ${elapsed} s")
endif()
if(NOT err MATCHES "vpce: error: rank [02]: timeout: [^\n]*within --timeout 2 s")
  message(FATAL_ERROR "expected a timeout error line from rank 0 or 2, got:\n${err}")
endif()
if(EXISTS ${WORK_DIR}/out)
  message(FATAL_ERROR "an output directory was written")
endif()
