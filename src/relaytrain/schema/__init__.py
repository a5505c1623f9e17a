"""The ground floor: the run config's typed schema and enums, and a row's fields."""
