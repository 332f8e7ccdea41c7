"""What this machine is (probe), what it costs to run Tandem's kernels on it (calibrate), and the
versioned profile that keeps those costs between runs (profile).

Convention shared by the probe and the profile: a field that could not be measured is None and its
dict carries `unavailable = {field: reason}`, so a reader can always say why a value is missing.
"""
