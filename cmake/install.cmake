# The installed package (docs/api.md): libkvferry.so, the public headers (include/kvferry), the
# CMake package (find_package(kvferry) -> kvferry::kvferry) and kvferry.pc.
#
# Why a shared library: what kvferry links (UCX, MPI, liburing, xxHash, fmt, nlohmann_json, the
# CUDA runtime) stays private to it, so a consumer needs the headers and one library and no
# find_dependency, and no vendor type can reach it (the public headers name none). Libraries found
# outside the system directories (the UCX wheel, CUDA) are found through the library's RUNPATH.
# Included from src/CMakeLists.txt, after the layers are declared.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

add_library(kvferry_shared SHARED)
foreach(l ${KVFERRY_LAYERS})
  target_link_libraries(kvferry_shared PRIVATE kvferry_${l})
endforeach()
target_include_directories(kvferry_shared INTERFACE
  "$<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>" "$<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>")
target_compile_features(kvferry_shared INTERFACE cxx_std_20)
# Before 1.0 the ABI may change with every minor version (README.md, "Stability").
set_target_properties(kvferry_shared PROPERTIES OUTPUT_NAME kvferry EXPORT_NAME kvferry
  VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR}
  INSTALL_RPATH_USE_LINK_PATH ON)
if(KVFERRY_HAVE_UCX AND UCX_LIBRARY_DIRS)  # pkg-config flags: not seen by the link path above
  set_property(TARGET kvferry_shared APPEND PROPERTY INSTALL_RPATH ${UCX_LIBRARY_DIRS})
endif()
add_library(kvferry::kvferry ALIAS kvferry_shared)
# Symbols of static archives linked into the library stay inside it. A toolchain that links the C++
# runtime statically (the H200 image's /opt/gcc g++) otherwise makes libkvferry.so export
# libstdc++'s ~4,200 symbols and its ABI (__cxa_throw, __cxxabiv1::...), and a consumer's own calls
# into its runtime may then bind to the library's copy. GNU ld, gold and lld have the option.
include(CheckLinkerFlag)
check_linker_flag(CXX "-Wl,--exclude-libs,ALL" KVFERRY_LINKER_EXCLUDE_LIBS)
if(KVFERRY_LINKER_EXCLUDE_LIBS)
  target_link_options(kvferry_shared PRIVATE "-Wl,--exclude-libs,ALL")
endif()

install(TARGETS kvferry_shared EXPORT kvferryTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/kvferry" DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
set(_cmakedir "${CMAKE_INSTALL_LIBDIR}/cmake/kvferry")
install(EXPORT kvferryTargets NAMESPACE kvferry:: DESTINATION ${_cmakedir} FILE kvferryTargets.cmake)
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/kvferryConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/kvferryConfig.cmake" INSTALL_DESTINATION ${_cmakedir})
write_basic_package_version_file("${PROJECT_BINARY_DIR}/kvferryConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/kvferryConfig.cmake" "${PROJECT_BINARY_DIR}/kvferryConfigVersion.cmake"
        DESTINATION ${_cmakedir})
# kvferry.pc finds its prefix from where it lies (${pcfiledir}), so the prefix given at install
# time (cmake --install --prefix) works.
string(REGEX REPLACE "[^/]+" ".." KVFERRY_PC_UP "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
configure_file("${PROJECT_SOURCE_DIR}/cmake/kvferry.pc.in" "${PROJECT_BINARY_DIR}/kvferry.pc" @ONLY)
install(FILES "${PROJECT_BINARY_DIR}/kvferry.pc" DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
