module github.com/moatsandbox/moat

go 1.26.8

require (
	github.com/landlock-lsm/go-landlock v0.11.2 // indirect
	golang.org/x/net v0.62.0 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
