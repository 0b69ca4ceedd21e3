"""The packer: a refresh cycle's curvature tasks placed into the bubbles of a schedule, its plan and its report."""
