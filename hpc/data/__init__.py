"""Tasks and their data: the built-in toy tasks, GSM8K / MATH files, and answer grading."""
