"""Worker supervision: launch a gang's processes on this node, capture their output, report their exits."""
