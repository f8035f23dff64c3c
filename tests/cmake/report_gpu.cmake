# ctest's CTEST_CUSTOM_POST_TEST (CTestCustom.cmake in the build folder, written by
# tests/CMakeLists.txt): runs the GPU probe, whose one line says whether the GPU tests ran and why
# not. Never fails ctest: a probe not built (a build of some targets only) is said, not an error.
#   cmake -DQBL_GPU_PROBE=<path of gpu_probe> -P report_gpu.cmake
if(NOT EXISTS "${QBL_GPU_PROBE}")
  message(NOTICE "qbl: ${QBL_GPU_PROBE} is not built, so nothing says whether the GPU tests ran")
  return()
endif()
execute_process(COMMAND "${QBL_GPU_PROBE}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(NOTICE "qbl: ${QBL_GPU_PROBE} failed (${rc})")
endif()
