# libkvferry.so exports the public API only (include/kvferry/export.h): every exported symbol
# that names kvferry names only what include/kvferry declares. The second test feeds the checker
# a list with known leaks, which it must name.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_FOUND)
  set(_dir "${PROJECT_SOURCE_DIR}/tests/symbols")
  add_test(NAME symbols.exports_only_public_api
           COMMAND Python3::Interpreter ${_dir}/check_exports.py $<TARGET_FILE:kvferry_shared>
                   ${PROJECT_SOURCE_DIR}/include)
  add_test(NAME symbols.checker_names_leaks
           COMMAND Python3::Interpreter ${_dir}/check_exports.py --symbols
                   ${_dir}/leaky_symbols.txt ${PROJECT_SOURCE_DIR}/include)
  set_tests_properties(symbols.checker_names_leaks PROPERTIES PASS_REGULAR_EXPRESSION
    "5 leaked.*UcxTransport.*anonymous namespace.*XXH3_64bits.*SlotLease.*__cxa_throw")
  # The same library linked with the C++ runtime static, as the H200 image's toolchain links it
  # (it exported 4,510 symbols there, the runtime's ABI among them): the public API only still.
  include(CheckLinkerFlag)
  check_linker_flag(CXX "-static-libstdc++" KVFERRY_HAVE_STATIC_LIBSTDCXX)
  if(KVFERRY_HAVE_STATIC_LIBSTDCXX)
    add_library(kvferry_static_runtime_check SHARED)
    foreach(l ${KVFERRY_LAYERS})
      target_link_libraries(kvferry_static_runtime_check PRIVATE kvferry_${l})
    endforeach()
    get_target_property(_opts kvferry_shared LINK_OPTIONS)
    if(_opts)
      target_link_options(kvferry_static_runtime_check PRIVATE ${_opts})
    endif()
    target_link_options(kvferry_static_runtime_check PRIVATE -static-libstdc++)
    add_test(NAME symbols.static_runtime_exports_only_public_api
             COMMAND Python3::Interpreter ${_dir}/check_exports.py
                     $<TARGET_FILE:kvferry_static_runtime_check> ${PROJECT_SOURCE_DIR}/include)
  endif()
endif()
