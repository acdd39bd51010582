# tests/mpi/fresh_inputs.cmake: included by the `vpce run --backend mpi` test scripts: an
# empty WORK_DIR with a small generated problem in WORK_DIR/in (logits.npy, targets.npy).
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${VPCE} gen --tokens 16 --vocab 50 --out ${WORK_DIR}/in RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "vpce gen failed")
endif()
