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
    "4 leaked.*UcxTransport.*anonymous namespace.*XXH3_64bits.*SlotLease")
endif()
