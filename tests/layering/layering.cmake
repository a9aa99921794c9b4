# The layers hold: a wrong-way include is a compile error (src/CMakeLists.txt, kvferry_layer).
# Each test compiles one file against the include root a layer's (or the tools') sources get;
# the negative ones pass only when the compiler says the header is not there.
set(_dir "${PROJECT_SOURCE_DIR}/tests/layering")
set(_cc ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only -I${CMAKE_BINARY_DIR}/src/generated)
set(_missing "(: No such file or directory|' file not found)")
add_test(NAME layering.planner_includes_below_compiles
         COMMAND ${_cc} -I${KVFERRY_LAYER_ROOTS}/planner ${_dir}/planner_includes_below.cc)
add_test(NAME layering.planner_includes_tiering_fails
         COMMAND ${_cc} -I${KVFERRY_LAYER_ROOTS}/planner ${_dir}/planner_includes_tiering.cc)
set_tests_properties(layering.planner_includes_tiering_fails PROPERTIES
                     PASS_REGULAR_EXPRESSION "tiering/copy_plan.h'?${_missing}")
add_test(NAME layering.wire_includes_below_compiles
         COMMAND ${_cc} -I${KVFERRY_LAYER_ROOTS}/wire -I${KVFERRY_XXHASH_INCLUDE}
                 ${_dir}/wire_includes_below.cc)
add_test(NAME layering.wire_includes_engine_fails
         COMMAND ${_cc} -I${KVFERRY_LAYER_ROOTS}/wire ${_dir}/wire_includes_engine.cc)
set_tests_properties(layering.wire_includes_engine_fails PROPERTIES
                     PASS_REGULAR_EXPRESSION "transceiver/engine/engine.h'?${_missing}")
add_test(NAME layering.base_includes_transceiver_api_fails
         COMMAND ${_cc} -I${KVFERRY_LAYER_ROOTS}/base ${_dir}/base_includes_transceiver_api.cc)
set_tests_properties(layering.base_includes_transceiver_api_fails PROPERTIES
                     PASS_REGULAR_EXPRESSION "kvferry/transceiver.h'?${_missing}")
if(KVFERRY_BUILD_TOOLS)
  add_test(NAME layering.tool_includes_src_fails
           COMMAND ${_cc} -I${PROJECT_SOURCE_DIR}/include -I${PROJECT_BINARY_DIR}/tools/include_root
                   ${_dir}/tool_includes_src.cc)
  set_tests_properties(layering.tool_includes_src_fails PROPERTIES
                       PASS_REGULAR_EXPRESSION "transport/ucx_transport_impl.h'?${_missing}")
endif()
# Test support is not in the layers' folders: outside src/testing and src/selftest only the tests
# themselves (*_test.cc) include a testing/ or selftest/ header; the control must report its
# fixture's helper (test_support_in_layer.sh says why).
set(_layer_dirs)
foreach(l ${KVFERRY_LAYERS})
  list(APPEND _layer_dirs ${KVFERRY_LAYER_${l}_DIRS})
endforeach()
list(REMOVE_DUPLICATES _layer_dirs)
add_test(NAME layering.layer_folders_hold_no_test_support
         COMMAND sh ${_dir}/test_support_in_layer.sh ${CMAKE_CURRENT_SOURCE_DIR} ${_layer_dirs})
set_tests_properties(layering.layer_folders_hold_no_test_support PROPERTIES
                     PASS_REGULAR_EXPRESSION "^PASS" FAIL_REGULAR_EXPRESSION "FAIL")
add_test(NAME layering.test_support_in_layer_folder_fails
         COMMAND sh ${_dir}/test_support_in_layer.sh ${_dir} test_support_fixture)
set_tests_properties(layering.test_support_in_layer_folder_fails PROPERTIES
                     PASS_REGULAR_EXPRESSION
                     "FAIL: test_support_fixture/shared_helper.h:[0-9]+:#include \"testing/testdata.h\""
                     FAIL_REGULAR_EXPRESSION "thing_test.cc")
# Every public header compiles on its own against include/ alone (no src/ header, no vendor
# header: the CUDA, UCX and MPI include directories are not given).
file(GLOB _public RELATIVE "${PROJECT_SOURCE_DIR}/include" "${PROJECT_SOURCE_DIR}/include/kvferry/*.h")
add_test(NAME layering.public_headers_stand_alone COMMAND sh -c
         "for h in \"$@\"; do echo \"#include \\\"$h\\\"\" | ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only -Wall -Wextra -Werror -I${PROJECT_SOURCE_DIR}/include -x c++ - || { echo \"FAIL: $h\"; exit 1; }; done; echo PASS"
         sh ${_public})
set_tests_properties(layering.public_headers_stand_alone PROPERTIES PASS_REGULAR_EXPRESSION "PASS"
                     FAIL_REGULAR_EXPRESSION "FAIL")
# Clang's thread-safety analysis sees the annotations (src/base/thread_annotations.h): an
# unguarded read of a GUARDED_BY member is an error under -Werror=thread-safety, a guarded one is
# not. CI's clang builds (build-fuzz, the tsan preset) rely on it; this runs with any compiler
# where clang++ is installed.
find_program(KVFERRY_CLANGXX clang++)
if(KVFERRY_CLANGXX)
  set(_ts ${KVFERRY_CLANGXX} -std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety
          -I${PROJECT_SOURCE_DIR}/src ${_dir}/thread_safety_unguarded.cc)
  add_test(NAME thread_safety.guarded_access_compiles COMMAND ${_ts})
  add_test(NAME thread_safety.unguarded_access_fails COMMAND ${_ts} -DKVF_UNGUARDED)
  set_tests_properties(thread_safety.unguarded_access_fails PROPERTIES
                       PASS_REGULAR_EXPRESSION "reading variable 'n_' requires holding mutex 'mu_'")
endif()
