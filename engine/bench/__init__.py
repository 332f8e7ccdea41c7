"""The benchmark harness behind `tandem bench`: one JSON record per configuration."""
