package server

import (
	"errors"
	"strings"
)

// message is err's text for an error body. The body's code already names
// the error's class, so the words of the classes err matches (errorTable's
// targets: ": server: malformed request", ": invalid input") are dropped
// from the end of the text, however many of them the wrap sites added; an
// error that is nothing but its class keeps its words.
func message(err error) string {
	msg := err.Error()
	for trimmed := true; trimmed; {
		trimmed = false
		for _, e := range errorTable {
			rest, ok := strings.CutSuffix(msg, ": "+e.target.Error())
			if ok && rest != "" && errors.Is(err, e.target) {
				msg, trimmed = rest, true
			}
		}
	}
	return msg
}
