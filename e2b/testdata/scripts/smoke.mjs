// Drives a moat serve through the unchanged E2B SDK: create, commands.run,
// files.write and read, stdin, background commands, list, kill. The Go tests
// (e2b's TestSDK, once per SDK harness, and cmd/moat's
// TestServeE2BEveryLevel) run it with
// E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL pointing at the server and
// E2B_DOMAIN at a name that does not resolve, and checks what it prints:
// one JSON line per step.
import { Sandbox, CommandExitError } from 'e2b'

const out = (step, v) => console.log(JSON.stringify({ step, ...v }))

// MOAT_TEMPLATE names the template (cmd/moat's test runs one per level).
const template = process.env.MOAT_TEMPLATE || 'base'
const sbx = await Sandbox.create(template, { metadata: { suite: 'moat' } })
out('create', { id: sbx.sandboxId })

const hi = await sbx.commands.run('echo hi')
out('run', { stdout: hi.stdout, stderr: hi.stderr, exitCode: hi.exitCode })

const env = await sbx.commands.run('[ "$PWD" = "$HOME" ] && echo "$GREETING at home"; echo oops >&2', { envs: { GREETING: 'hello' }, cwd: '/home/user' })
out('env', { stdout: env.stdout, stderr: env.stderr })

try {
  await sbx.commands.run('exit 3')
  out('exit', { exitCode: 0 })
} catch (e) {
  out('exit', { exitCode: e instanceof CommandExitError ? e.exitCode : -999, name: e.name })
}

const streamed = []
await sbx.commands.run('for i in 1 2 3; do echo line$i; done', { onStdout: (d) => streamed.push(d) })
out('stream', { chunks: streamed.join('') })

const info = await sbx.files.write('/home/user/notes/hello.txt', 'hello from the sdk')
out('write', { path: info.path, name: info.name })
out('read', { text: await sbx.files.read('/home/user/notes/hello.txt') })
const cat = await sbx.commands.run('cat notes/hello.txt')
out('cat', { stdout: cat.stdout })
await sbx.commands.run('echo made by bash > made.txt')
out('readback', { text: await sbx.files.read('made.txt') })
out('list', { names: (await sbx.files.list('/home/user')).map((e) => e.name + ':' + e.type) })
out('exists', { yes: await sbx.files.exists('notes/hello.txt'), no: await sbx.files.exists('nope.txt') })
try {
  await sbx.files.read('/etc/passwd')
  out('outside', { error: '' })
} catch (e) {
  out('outside', { error: e.name })
}

// stdin: a background command reading its input, sent in two pieces and
// closed.
const reader = await sbx.commands.run('while read -r l; do echo "got $l"; done; echo eof', { background: true, stdin: true })
await sbx.commands.sendStdin(reader.pid, 'one\n')
await reader.sendStdin('two\n')
await reader.closeStdin()
const read = await reader.wait()
out('stdin', { stdout: read.stdout, exitCode: read.exitCode })

let sawStart
const started = new Promise((resolve) => { sawStart = resolve })
const bg = await sbx.commands.run('echo started; sleep 30', { background: true, onStdout: (d) => d.includes('started') && sawStart() })
await started
const running = await sbx.commands.list()
await bg.kill()
let bgEnd
try {
  await bg.wait()
  bgEnd = 'exited'
} catch (e) {
  bgEnd = e.name + ' ' + e.exitCode
}
out('background', { pids: running.map((p) => p.pid), pid: bg.pid, stdout: bg.stdout, end: bgEnd })
const after = await sbx.commands.run('echo after')
out('after', { stdout: after.stdout })

const listed = await Sandbox.list({ query: { metadata: { suite: 'moat' } } }).nextItems()
out('listed', { ids: listed.map((s) => s.sandboxId) })

out('kill', { killed: await sbx.kill() })
out('running', { running: await sbx.isRunning() })
