"""The benchmark harness behind `tandem bench`: functions that measure and return JSON records."""
