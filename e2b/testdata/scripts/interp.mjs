// Drives a moat serve through the unchanged code interpreter SDK: runCode
// with the last expression's value, stdout and stderr, structured errors,
// variables kept between calls, and commands and files in the same
// sandbox. The Go tests (e2b's TestCodeInterpreterSDK, cmd/moat's
// TestServeE2BEveryLevel) run it as smoke.mjs, and check what it prints:
// one JSON line per step.
import { Sandbox } from '@e2b/code-interpreter'

const out = (step, v) => console.log(JSON.stringify({ step, ...v }))
// MOAT_TEMPLATE names the template (cmd/moat's test runs one per level).
const sbx = await Sandbox.create(process.env.MOAT_TEMPLATE || 'code-interpreter-v1')
out('create', { id: sbx.sandboxId })

const first = await sbx.runCode('x = 6 * 7\nprint("printed")\nx')
out('first', { text: first.text, stdout: first.logs.stdout, stderr: first.logs.stderr, error: first.error ?? null })

const kept = await sbx.runCode('x + 1')
out('kept', { text: kept.text })

const err = await sbx.runCode('import sys\nprint("to stderr", file=sys.stderr)\n1 / 0')
out('error', { name: err.error?.name, value: err.error?.value, traceback: err.error?.traceback?.includes('ZeroDivisionError') ?? false, stderr: err.logs.stderr })

const lines = []
await sbx.runCode('for i in range(3):\n    print(i)', { onStdout: (m) => lines.push(m.line) })
out('stream', { lines })

const none = await sbx.runCode('y = 1')
out('none', { text: none.text ?? null, results: none.results.length })

await sbx.files.write('/home/user/data.txt', 'from the files api')
const read = await sbx.runCode('open("data.txt").read()')
out('files', { text: read.text })

const cmd = await sbx.commands.run('echo from bash; ls data.txt')
out('command', { stdout: cmd.stdout })
const after = await sbx.runCode('x')
out('after', { text: after.text })

out('kill', { killed: await sbx.kill() })
