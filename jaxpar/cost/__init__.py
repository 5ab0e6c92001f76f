"""What a step costs: compiled HLO read for collectives, hardware profiles, each strategy's cost facts and
`explain`."""
