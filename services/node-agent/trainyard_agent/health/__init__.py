"""GPU health: the policy that turns faults into health states (data), and the book that holds them."""
