# tests/mpi/expect_job_ends.cmake: runs COMMAND (;-separated) and requires it to fail within
# SECONDS: the launcher must end a job whose rank died, not leave the others waiting.
cmake_minimum_required(VERSION 3.22)
string(TIMESTAMP start "%s")
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT ${SECONDS})
string(TIMESTAMP end "%s")
math(EXPR elapsed "${end} - ${start}")
message(STATUS "exit: ${result} after ${elapsed} s\n${out}\n${err}")
if(result MATCHES "timeout" OR elapsed GREATER_EQUAL ${SECONDS})
  message(FATAL_ERROR "the job was still running after ${SECONDS} s")
endif()
if(result EQUAL 0)
  message(FATAL_ERROR "the job succeeded, but one of its ranks was killed")
endif()
if(out MATCHES "forward returned")
  message(FATAL_ERROR "a survivor left the forward as if nothing had happened")
endif()
