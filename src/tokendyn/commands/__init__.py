"""Commands that drive several rooms at once (the demo trains, then draws): above trainers/ and figures/, so
neither of those imports the other."""
