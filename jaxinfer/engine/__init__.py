"""Engine: scheduler (host), runner (device), and the loop that joins them."""
