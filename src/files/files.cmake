# The file tier (src/files): SlabStore, the FileBackend seam and its backends, tests, fuzz (its
# bench, slab_store_bench, is test support: src/testing).
# Included from src/CMakeLists.txt after the files layer (kvferry_files) is declared.

target_sources(kvferry_files PRIVATE
  files/posix_backend.cc
  files/posix_io.cc
  files/slab_store.cc
  files/slot_header.cc
)
# xxHash checksums the slots (the base layer brings it). libcufile is dlopen'ed at run time (a
# missing libcufile, CUDA driver or GDS means posix, logged), so only cufile.h is needed to build.
if(KVFERRY_HAVE_URING)
  target_sources(kvferry_files PRIVATE files/uring_backend.cc)
  target_link_libraries(kvferry_files PUBLIC PkgConfig::URING)
endif()
if(KVFERRY_HAVE_CUFILE)
  target_sources(kvferry_files PRIVATE files/cufile_backend.cc)
  set_source_files_properties(files/cufile_backend.cc PROPERTIES
    INCLUDE_DIRECTORIES "${KVFERRY_CUFILE_INCLUDE};${CUDAToolkit_INCLUDE_DIRS}")
endif()

if(BUILD_TESTING)
  kvferry_test(files_test SOURCES files/slot_header_test.cc files/file_backend_test.cc
               files/slab_store_test.cc files/slab_recovery_test.cc files/slab_store_security_test.cc
               "${PROJECT_SOURCE_DIR}/fuzz/slot_header_fuzz_body.cc")
endif()

# libFuzzer target: clang with -fsanitize=fuzzer only (-DKVFERRY_FUZZ=ON). The decoder is compiled
# into the target so that it is instrumented.
if(KVFERRY_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "KVFERRY_FUZZ needs clang (-fsanitize=fuzzer)")
  endif()
  add_executable(slot_header_fuzz "${PROJECT_SOURCE_DIR}/fuzz/slot_header_fuzz.cc"
                 files/slot_header.cc "${PROJECT_SOURCE_DIR}/fuzz/slot_header_fuzz_body.cc")
  target_compile_options(slot_header_fuzz PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(slot_header_fuzz PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(slot_header_fuzz PRIVATE kvferry_internal)
endif()
