set(GRADWATCH_ANALYTICS_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/regression.cc
  ${CMAKE_CURRENT_LIST_DIR}/event_slope.cc
  ${CMAKE_CURRENT_LIST_DIR}/forecast.cc
  ${CMAKE_CURRENT_LIST_DIR}/change_point.cc
  ${CMAKE_CURRENT_LIST_DIR}/attribution.cc
  ${CMAKE_CURRENT_LIST_DIR}/spike_filter.cc
)
