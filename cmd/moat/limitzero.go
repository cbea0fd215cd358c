package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"reflect"
	"strings"

	"github.com/moatsandbox/moat"
)

// A limit given as zero is refused, on the command line and in the config
// file. In moat.Limits a zero field means the default, which is what an
// absent flag or key gives; a zero written out ("--wall-time 0", "pids":
// 0) reads as "no limit" or "none allowed" to a newcomer and would
// silently be neither.

// limitDefault is the default of the limit whose JSON name is key
// ("wall_time"), as its flag prints it.
func limitDefault(key string) string {
	d := reflect.ValueOf(moat.DefaultLimits())
	idx, ok := jsonFields(d.Type())[key]
	if !ok {
		return "?"
	}
	return fmt.Sprint(d.FieldByIndex(idx).Interface())
}

// checkZeroLimitFlags refuses a limit flag given on the command line with
// the value zero, naming the flag as it was spelt. flags is the config
// the flags of fs write into.
func checkZeroLimitFlags(fs *flag.FlagSet, flags *fileConfig) error {
	keys := flagKeys(fs, flags)
	var err error
	fs.Visit(func(f *flag.Flag) {
		key, ok := keys[canonical(f)]
		if !ok || err != nil || !strings.HasPrefix(key, "limits.") {
			return
		}
		if v := reflect.ValueOf(f.Value); v.Kind() == reflect.Pointer && v.Elem().IsZero() {
			name := strings.TrimPrefix(key, "limits.")
			err = fmt.Errorf("--%s %s: a limit cannot be zero: leave the flag out for the default (%s): %w", f.Name, f.Value, limitDefault(name), moat.ErrInvalid)
		}
	})
	return err
}

// checkZeroLimitKeys refuses a key of the config file's limits section
// (data is the whole file, already decoded once without error) whose
// value is zero.
func checkZeroLimitKeys(data []byte) error {
	var top map[string]json.RawMessage
	if json.Unmarshal(data, &top) != nil {
		return nil // decodeConfig has said what is wrong
	}
	raw, ok := top["limits"]
	if !ok || string(bytes.TrimSpace(raw)) == "null" {
		return nil
	}
	return eachMember("limits", raw, func(key string, val json.RawMessage) error {
		if string(bytes.TrimSpace(val)) == "null" {
			return nil
		}
		one, _ := json.Marshal(map[string]json.RawMessage{key: val})
		var l moat.Limits
		if err := decodeObject("limits", one, reflect.ValueOf(&l).Elem()); err != nil {
			return err
		}
		if l == (moat.Limits{}) {
			return configErr("limits.%s: %s: a limit cannot be zero: leave the key out for the default (%s)", key, shown(val), limitDefault(key))
		}
		return nil
	})
}
