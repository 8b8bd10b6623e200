"""The layout planner: a cost model calibrated per machine, a search over layouts and placements."""
