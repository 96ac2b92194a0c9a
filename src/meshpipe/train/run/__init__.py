"""A run decided once, before any rank starts: the config from the command line or a TOML
file, the devices and backend, the schedule, the layer split, the resume, and what is trained
on what (``sources``). Ranks receive the resulting ``RunPlan``; nothing here runs a step."""
