# Fuzz targets (fuzz/): libFuzzer binaries with -DKVFERRY_FUZZ=ON (clang), and in every build the
# FuzzBodies gtest that runs each body over the checked-in corpus and mutated inputs.
# Included from src/CMakeLists.txt after the kvferry library is declared.

set(KVFERRY_FUZZ_DIR "${PROJECT_SOURCE_DIR}/fuzz")
set(kvferry_fuzz_bodies "${KVFERRY_FUZZ_DIR}/wire_fuzz_bodies.cc" "${KVFERRY_FUZZ_DIR}/protocol_fuzz_body.cc"
                        "${KVFERRY_FUZZ_DIR}/rendezvous_frame_fuzz_body.cc")
if(NOT KVFERRY_HAVE_UCX)
  # The UCX address codec has no UCX dependency; the library only builds it with UCX.
  list(APPEND kvferry_fuzz_bodies "${CMAKE_CURRENT_SOURCE_DIR}/transport/ucx_address.cc")
endif()

if(BUILD_TESTING)
  kvferry_test(fuzz_test SOURCES "${KVFERRY_FUZZ_DIR}/fuzz_test.cc" ${kvferry_fuzz_bodies})
  target_include_directories(fuzz_test PRIVATE "${KVFERRY_XXHASH_INCLUDE}")
  target_link_libraries(fuzz_test PRIVATE "${KVFERRY_XXHASH_LIB}")
  target_compile_definitions(fuzz_test PRIVATE KVFERRY_FUZZ_CORPUS="${KVFERRY_FUZZ_DIR}/corpus")
  # Each body defines its own Check/CheckRefusal macros and helpers: no unity build here.
  set_target_properties(fuzz_test PROPERTIES UNITY_BUILD OFF)
endif()

# Regenerates the seed corpora: make_seeds fuzz/corpus
add_executable(make_seeds "${KVFERRY_FUZZ_DIR}/make_seeds.cc")
if(NOT KVFERRY_HAVE_UCX)
  target_sources(make_seeds PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/transport/ucx_address.cc")
endif()
target_link_libraries(make_seeds PRIVATE kvferry_internal)

if(KVFERRY_FUZZ)
  # The library itself is instrumented (coverage, ASan, UBSan) by the top-level KVFERRY_FUZZ
  # flags; each target links libFuzzer's main.
  foreach(t handle message ucx_address nixl_wire protocol rendezvous_frame)
    add_executable(${t}_fuzz "${KVFERRY_FUZZ_DIR}/${t}_fuzz.cc" ${kvferry_fuzz_bodies})
    set_target_properties(${t}_fuzz PROPERTIES UNITY_BUILD OFF)
    target_compile_options(${t}_fuzz PRIVATE -fsanitize=fuzzer,address,undefined)
    target_link_options(${t}_fuzz PRIVATE -fsanitize=fuzzer,address,undefined)
    target_include_directories(${t}_fuzz PRIVATE "${KVFERRY_XXHASH_INCLUDE}")
    target_link_libraries(${t}_fuzz PRIVATE kvferry_internal "${KVFERRY_XXHASH_LIB}")
  endforeach()
endif()
