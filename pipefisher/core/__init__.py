"""The shared vocabulary: the op IR, where ranks live, the profile format and file handling. Pure Python: no torch."""
