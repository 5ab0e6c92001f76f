"""What a step costs: compiled HLO read for collectives, hardware profiles, the event simulator and `explain`."""
